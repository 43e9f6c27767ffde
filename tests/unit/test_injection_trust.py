"""The webhook carries the trust and availability settings to the sidecar it injects."""

from __future__ import annotations

from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from cachefleet_operator import injection
from cachefleet_sidecar import config as sidecar_config

CACHE = {
    "metadata": {"namespace": "inference", "name": "chat"},
    "spec": {"redis": {"url": "redis://r:6379/0", "outageStalenessSeconds": 30}},
}


def test_outage_choice_and_trusted_proxies_reach_the_sidecar(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    info = injection.cache_info(CACHE)
    assert info.outage_staleness_s == 30
    settings = injection.SidecarSettings.model_validate(
        {"image": "cachefleet:test", "trustedProxies": "10.20.0.0/16"}
    )
    container = injection.sidecar_container(info, settings)
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["CACHEFLEET_REDIS_OUTAGE_STALENESS"] == "30"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = sidecar_config.parse_args([])
    assert cfg.control.redis_outage_staleness_s == 30.0
    assert cfg.tenancy.trusted_proxies == ("10.20.0.0/16",)


def test_strict_is_the_default() -> None:
    info = injection.cache_info({"metadata": {"namespace": "a", "name": "b"}, "spec": {}})
    settings = injection.SidecarSettings.model_validate({"image": "cachefleet:test"})
    names = {e["name"] for e in injection.sidecar_container(info, settings)["env"]}
    assert "CACHEFLEET_REDIS_OUTAGE_STALENESS" not in names
    assert "CACHEFLEET_TRUSTED_PROXIES" not in names
    assert sidecar_config.parse_args([]).control.redis_outage_staleness_s == 0.0


def _pod(annotations: dict[str, str], volumes: list[Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "vllm", "image": "vllm:latest"}]}
    if volumes is not None:
        spec["volumes"] = volumes
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "p",
            "labels": {injection.CACHE_LABEL: "chat"},
            "annotations": annotations,
        },
        "spec": spec,
    }


@pytest.mark.parametrize("volumes", [None, [{"name": "models", "emptyDir": {}}]])
def test_api_keys_secret_is_mounted_and_named_to_the_sidecar(volumes: list[Any] | None) -> None:
    settings = injection.SidecarSettings.model_validate({"image": "cachefleet:test"})
    pod = _pod({injection.API_KEYS_ANNOTATION: "chat-keys"}, volumes)
    ops = injection.injection_patch(pod, "inference", settings)
    out = jsonpatch.apply_patch(pod, ops)
    kubernetes_validate.validate(out, "1.30", strict=True)
    volume = out["spec"]["volumes"][-1]
    assert volume["secret"]["secretName"] == "chat-keys"
    assert len(out["spec"]["volumes"]) == (len(volumes) if volumes else 0) + 1
    sidecar = out["spec"]["containers"][-1]
    (mount,) = sidecar["volumeMounts"]
    assert mount == {"name": volume["name"], "mountPath": injection.API_KEYS_DIR, "readOnly": True}
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["CACHEFLEET_API_KEYS_FILE"] == f"{injection.API_KEYS_DIR}/keys.json"


def test_api_keys_secret_must_be_a_secret_name() -> None:
    settings = injection.SidecarSettings.model_validate({"image": "cachefleet:test"})
    with pytest.raises(injection.InjectionError, match="api-keys-secret"):
        injection.injection_patch(
            _pod({injection.API_KEYS_ANNOTATION: "Not A Name"}), "inference", settings
        )
