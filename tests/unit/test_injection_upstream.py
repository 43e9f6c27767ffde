"""spec.upstream of an InferenceCache reaches its sidecars' connection pool (issue 23, item 4)."""

from __future__ import annotations

import pydantic
import pytest

from cachefleet_operator import api, injection
from cachefleet_sidecar import config as sidecar_config
from cachefleet_sidecar.http import upstream


def test_the_pool_bounds_flow_from_the_crd_to_the_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = {
        "metadata": {"namespace": "inference", "name": "chat"},
        "spec": {"upstream": {"maxConnections": 32, "maxQueued": 0}},
    }
    info = injection.cache_info(cache)
    settings = injection.SidecarSettings.model_validate({"image": "cachefleet:test"})
    env = {
        e["name"]: e["value"]
        for e in injection.sidecar_container(info, settings)["env"]
        if "value" in e
    }
    assert env["CACHEFLEET_UPSTREAM_MAX_CONNECTIONS"] == "32"
    assert env["CACHEFLEET_UPSTREAM_MAX_QUEUED"] == "0"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = sidecar_config.parse_args([])
    assert (cfg.http.upstream_max_connections, cfg.http.upstream_max_queued) == (32, 0)


def test_without_the_field_the_sidecar_keeps_its_defaults() -> None:
    info = injection.cache_info({"metadata": {"namespace": "a", "name": "b"}, "spec": {}})
    settings = injection.SidecarSettings.model_validate({"image": "cachefleet:test"})
    names = {e["name"] for e in injection.sidecar_container(info, settings)["env"]}
    assert "CACHEFLEET_UPSTREAM_MAX_CONNECTIONS" not in names
    limits = api.UpstreamLimits()
    assert limits.max_connections == upstream.DEFAULT_MAX_CONNECTIONS == 256
    assert limits.max_queued == upstream.DEFAULT_MAX_WAITING


def test_a_bad_bound_is_refused_naming_the_field() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        api.UpstreamLimits.model_validate({"maxConnections": 0})
    assert "maxConnections" in str(info.value)
