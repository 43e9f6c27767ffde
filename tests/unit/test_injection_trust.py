"""The webhook carries the trust and availability settings to the sidecar it injects."""

from __future__ import annotations

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
    assert cfg.redis_outage_staleness_s == 30.0
    assert cfg.trusted_proxies == ("10.20.0.0/16",)


def test_strict_is_the_default() -> None:
    info = injection.cache_info({"metadata": {"namespace": "a", "name": "b"}, "spec": {}})
    settings = injection.SidecarSettings.model_validate({"image": "cachefleet:test"})
    names = {e["name"] for e in injection.sidecar_container(info, settings)["env"]}
    assert "CACHEFLEET_REDIS_OUTAGE_STALENESS" not in names
    assert "CACHEFLEET_TRUSTED_PROXIES" not in names
    assert sidecar_config.parse_args([]).redis_outage_staleness_s == 0.0
