"""Sidecar injection: which Pods get the sidecar, how it is configured, and the webhook glue."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import jsonpatch
import kopf
import pytest

from cachefleet_operator import injection, webhook
from cachefleet_operator.injection import (
    CACHE_LABEL,
    INJECTED_ANNOTATION,
    SIDECAR_NAME,
    CacheInfo,
    InjectionError,
    SidecarSettings,
)
from cachefleet_sidecar import config as sidecar_config

SETTINGS = SidecarSettings(image="ghcr.io/cachefleet/cachefleet:0.1.0")

CACHE_OBJ = {
    "apiVersion": "cachefleet.io/v1alpha1",
    "kind": "InferenceCache",
    "metadata": {"name": "llama-chat", "namespace": "inference"},
    "spec": {
        "model": {"name": "m", "version": "2024-07-23"},
        "capacity": {"l1BytesPerPod": 536870912, "l2Bytes": 1 << 34},
        "redis": {"secretRef": {"name": "llama-redis", "key": "url"}},
        "defaultPolicy": "lirs",
    },
}


def pod(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> Any:
    meta: dict[str, Any] = {"generateName": "vllm-", "namespace": "inference"}
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = annotations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "containers": [
                {"name": "vllm", "image": "vllm/vllm-openai", "ports": [{"containerPort": 8000}]}
            ]
        },
    }


def patched(p: dict[str, Any], cache: CacheInfo | None = None) -> dict[str, Any]:
    ops = injection.injection_patch(p, "inference", SETTINGS, cache)
    return jsonpatch.apply_patch(copy.deepcopy(p), ops)  # type: ignore[no-any-return]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_unlabelled_pod_is_not_patched() -> None:
    assert injection.injection_patch(pod(), "inference", SETTINGS) == []
    assert injection.injection_patch(pod({"app": "x"}), "inference", SETTINGS) == []


def test_opt_out_annotation_wins_over_label() -> None:
    p = pod({CACHE_LABEL: "llama-chat"}, {injection.INJECT_ANNOTATION: "false"})
    assert injection.injection_patch(p, "inference", SETTINGS) == []


def test_labelled_pod_gets_one_sidecar_and_a_second_pass_changes_nothing() -> None:
    once = patched(pod({CACHE_LABEL: "llama-chat"}))
    names = [c["name"] for c in once["spec"]["containers"]]
    assert names == ["vllm", SIDECAR_NAME]
    assert once["metadata"]["annotations"][INJECTED_ANNOTATION] == "inference/llama-chat"
    assert injection.injection_patch(once, "inference", SETTINGS) == []
    # a manifest that already lists the sidecar (e.g. applied from a dump) is left alone too
    manual = pod({CACHE_LABEL: "llama-chat"})
    manual["spec"]["containers"].append({"name": SIDECAR_NAME, "image": "x"})
    assert injection.injection_patch(manual, "inference", SETTINGS) == []


def test_existing_annotations_are_kept() -> None:
    out = patched(pod({CACHE_LABEL: "c"}, {"team": "ml"}))
    assert out["metadata"]["annotations"] == {"team": "ml", INJECTED_ANNOTATION: "inference/c"}


def test_sidecar_env_comes_from_the_cache_and_keeps_the_secret_in_the_secret() -> None:
    info = injection.cache_info(CACHE_OBJ)
    out = patched(pod({CACHE_LABEL: "llama-chat"}), info)
    env = env_of(out["spec"]["containers"][1])
    assert env["CACHEFLEET_CACHE"] == "inference/llama-chat"
    assert env["CACHEFLEET_REDIS_URL"] == {"secretKeyRef": {"name": "llama-redis", "key": "url"}}
    assert env["CACHEFLEET_MODEL_VERSION"] == "2024-07-23"
    assert env["CACHEFLEET_L1_BYTES"] == "536870912"
    assert env["CACHEFLEET_POLICY"] == "lirs"
    assert env["CACHEFLEET_POD"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_env_is_understood_by_the_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plain env var the webhook sets is a flag the sidecar parses to the intended value."""
    info = CacheInfo(
        namespace="inference",
        name="llama-chat",
        redis_url="redis://r:6379/0",
        model_version="v2",
        l1_bytes_per_pod=1024,
        policy="lirs",
    )
    container = injection.sidecar_container(info, SETTINGS)
    for e in container["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    monkeypatch.setenv("CACHEFLEET_POD", "vllm-abc")
    cfg = sidecar_config.parse_args([])
    assert cfg.cache == "inference/llama-chat"
    assert cfg.redis_url == "redis://r:6379/0"
    assert cfg.listen == ("0.0.0.0", SETTINGS.proxy_port)
    assert cfg.admin_listen == ("0.0.0.0", SETTINGS.admin_port)
    assert cfg.caching.l1_bytes == 1024
    assert cfg.caching.model_version == "v2"
    assert cfg.caching.policy.value == "lirs"


def test_namespace_header_and_warm_up_flow_from_the_cache_to_the_sidecar(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    obj = copy.deepcopy(CACHE_OBJ)
    obj["spec"]["namespaceHeader"] = "X-Knowledge-Base"
    obj["spec"]["warmup"] = {"bytes": 64 << 20, "timeoutSeconds": 7.5}
    container = injection.sidecar_container(injection.cache_info(obj), SETTINGS)
    env = env_of(container)
    assert env["CACHEFLEET_NAMESPACE_HEADER"] == "X-Knowledge-Base"
    assert env["CACHEFLEET_WARM_BYTES"] == str(64 << 20)
    for e in container["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    cfg = sidecar_config.parse_args([])
    assert cfg.caching.namespace_header == "X-Knowledge-Base"
    assert (cfg.control.warm_bytes, cfg.control.warm_timeout_s) == (64 << 20, 7.5)
    # without them: the sidecar's defaults (no warm-up)
    plain = env_of(injection.sidecar_container(injection.cache_info(CACHE_OBJ), SETTINGS))
    assert "CACHEFLEET_WARM_BYTES" not in plain
    assert "CACHEFLEET_NAMESPACE_HEADER" not in plain


def test_bad_warm_up_and_namespace_flags_are_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, flag in (
        (["--warm-bytes", "lots"], "--warm-bytes"),
        (["--warm-timeout", "0"], "--warm-timeout"),
        (["--namespace-header", "X KB"], "--namespace-header"),
    ):
        with pytest.raises(SystemExit):
            sidecar_config.parse_args(argv)
        assert flag in capsys.readouterr().err


def test_probes_hit_the_admin_port_and_upstream_annotation_overrides() -> None:
    p = pod({CACHE_LABEL: "c"}, {injection.UPSTREAM_ANNOTATION: "http://127.0.0.1:9000"})
    sidecar = patched(p)["spec"]["containers"][1]
    ports = {port["name"]: port["containerPort"] for port in sidecar["ports"]}
    assert ports == {"cf-proxy": 8080, "cf-admin": 8081}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "cf-admin"}
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "cf-admin"}
    assert env_of(sidecar)["CACHEFLEET_UPSTREAM"] == "http://127.0.0.1:9000"
    assert sidecar["resources"]["requests"]["cpu"] == "100m"


def test_port_clash_is_refused_with_the_container_named() -> None:
    p = pod({CACHE_LABEL: "c"})
    p["spec"]["containers"][0]["ports"] = [{"containerPort": 8080}]
    with pytest.raises(InjectionError, match="'vllm' already uses port 8080"):
        injection.injection_patch(p, "inference", SETTINGS)


def test_invalid_cache_name_is_refused() -> None:
    with pytest.raises(InjectionError, match="not a valid name"):
        injection.injection_patch(pod({CACHE_LABEL: "Bad_Name"}), "inference", SETTINGS)


def test_cache_from_another_namespace_is_not_used() -> None:
    other = CacheInfo(namespace="elsewhere", name="c", redis_url="redis://other:6379")
    env = env_of(patched(pod({CACHE_LABEL: "c"}), other)["spec"]["containers"][1])
    assert env["CACHEFLEET_CACHE"] == "inference/c"
    assert "CACHEFLEET_REDIS_URL" not in env


def test_settings_reject_unknown_keys() -> None:
    with pytest.raises(ValueError, match="imagee"):
        SidecarSettings.model_validate({"image": "x", "imagee": "y"})


# ------------------------------------------------------------------ webhook glue


async def run_handler(p: dict[str, Any], reader: Any) -> tuple[list[dict[str, Any]], list[str]]:
    memo = kopf.Memo(
        webhook=webhook.WebhookSetup(sidecar=SETTINGS, server=None, managed=None, reader=reader)
    )
    body = kopf.Body(p)
    patch = kopf.Patch(body=body)
    warnings: list[str] = []
    await webhook.inject_sidecar(
        body=body, patch=patch, memo=memo, warnings=warnings, logger=logging.getLogger("t")
    )
    return patch.as_json_patch(), warnings


async def test_webhook_reads_the_cache_and_answers_with_a_json_patch() -> None:
    seen: list[tuple[str, str]] = []

    async def reader(ns: str, name: str) -> dict[str, Any]:
        seen.append((ns, name))
        return CACHE_OBJ

    ops, warnings = await run_handler(pod({CACHE_LABEL: "llama-chat"}), reader)
    assert seen == [("inference", "llama-chat")]
    assert warnings == []
    result = jsonpatch.apply_patch(pod({CACHE_LABEL: "llama-chat"}), ops)
    env = env_of(result["spec"]["containers"][1])
    assert env["CACHEFLEET_MODEL_VERSION"] == "2024-07-23"


async def test_webhook_injects_l1_only_with_a_warning_when_the_cache_is_missing() -> None:
    async def reader(ns: str, name: str) -> None:
        return None

    ops, warnings = await run_handler(pod({CACHE_LABEL: "ghost"}), reader)
    assert any("no InferenceCache inference/ghost" in w for w in warnings)
    result = jsonpatch.apply_patch(pod({CACHE_LABEL: "ghost"}), ops)
    assert "CACHEFLEET_REDIS_URL" not in env_of(result["spec"]["containers"][1])


async def test_webhook_turns_a_port_clash_into_an_admission_error() -> None:
    p = pod({CACHE_LABEL: "c"})
    p["spec"]["containers"][0]["ports"] = [{"containerPort": 8081}]
    with pytest.raises(kopf.AdmissionError, match="8081"):
        await run_handler(p, None)


def test_service_webhook_server_names_the_service_in_its_certificate() -> None:
    server = webhook.ServiceWebhookServer(
        service="cachefleet-webhook", namespace="cf", service_port=443, port=9443
    )
    assert server.host == "cachefleet-webhook.cf.svc"
    assert "cachefleet-webhook.cf.svc" in server.extra_sans


async def test_self_signed_certificate_serves_tls_for_the_service_names(tmp_path: Path) -> None:
    import asyncio
    import ssl

    from cachefleet_operator.webhook import service_names, write_self_signed

    names = service_names("cachefleet-webhook", "cachefleet")
    cert, key = write_self_signed([*names, "127.0.0.1"], tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        client_ctx = ssl.create_default_context(cafile=str(cert))
        for name in ("cachefleet-webhook.cachefleet.svc", "127.0.0.1"):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_ctx, server_hostname=name
            )
            writer.write(b"ping\n")
            assert await reader.readline() == b"ping\n"
            writer.close()
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_ctx, server_hostname="evil.example"
            )
    finally:
        server.close()
        await server.wait_closed()
    assert oct(key.stat().st_mode & 0o777) == "0o600"


def test_prices_flow_from_the_cache_to_the_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    obj = copy.deepcopy(CACHE_OBJ)
    obj["spec"]["savings"] = {
        "currency": "USD",
        "prices": [
            {"model": "m", "promptPer1k": 0.5, "completionPer1k": 1.5},
            {"model": "*", "completionPer1k": 2},
        ],
    }
    container = injection.sidecar_container(injection.cache_info(obj), SETTINGS)
    for e in container["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    cfg = sidecar_config.parse_args([])
    assert cfg.caching.price_table == {"m": (0.5, 1.5), "*": (0.0, 2.0)}
    # no prices, or prices the API server would have refused: no flag, the sidecar's own
    for savings in (None, {"currency": "USD"}, {"prices": [{"model": "m", "promptPer1k": -1}]}):
        obj["spec"]["savings"] = savings
        env = env_of(injection.sidecar_container(injection.cache_info(obj), SETTINGS))
        assert "CACHEFLEET_PRICE_TABLE" not in env
