"""``spec.observability.otlpEndpoint`` reaches the injected sidecars as
``CACHEFLEET_OTLP_ENDPOINT`` (docs/tracing.md): checked from the CRD (pydantic and the
generated schema) through the webhook's container to the sidecar's own parser."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachefleet_operator import injection
from cachefleet_operator.api import SpecError, parse_spec
from cachefleet_sidecar import config as sidecar_config

from .crd_schema import spec_errors

EXAMPLE = Path(__file__).parents[2] / "examples" / "inferencecache.yaml"
COLLECTOR = "http://otel-collector.observability:4318"


def spec(**fields: Any) -> dict[str, Any]:
    raw: dict[str, Any] = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["spec"])
    raw.update(fields)
    return raw


def sidecar_env(raw_spec: dict[str, Any]) -> dict[str, str]:
    info = injection.cache_info({"metadata": {"namespace": "ns", "name": "chat"}, "spec": raw_spec})
    settings = injection.SidecarSettings.model_validate({"image": "cachefleet:test"})
    container = injection.sidecar_container(info, settings)
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_the_otlp_endpoint_flows_from_the_crd_to_the_sidecar(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = spec(observability={"otlpEndpoint": COLLECTOR})
    parsed = parse_spec(raw).observability
    assert parsed is not None
    assert parsed.otlp_endpoint == COLLECTOR
    assert spec_errors(raw) == []
    env = sidecar_env(raw)
    assert env["CACHEFLEET_OTLP_ENDPOINT"] == COLLECTOR
    for name in [n for n in os.environ if n.startswith("CACHEFLEET_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert sidecar_config.parse_args([]).observe.otlp_endpoint == COLLECTOR


def test_without_observability_no_sidecar_traces() -> None:
    assert "CACHEFLEET_OTLP_ENDPOINT" not in sidecar_env(spec())
    assert "CACHEFLEET_OTLP_ENDPOINT" not in sidecar_env(spec(observability={}))


def test_an_endpoint_that_is_not_http_is_refused_and_never_injected() -> None:
    raw = spec(observability={"otlpEndpoint": "otel-collector:4317"})
    assert spec_errors(raw)
    with pytest.raises(SpecError, match=r"spec\.observability\.otlpEndpoint"):
        parse_spec(raw)
    # written around the schema: the Pod still starts, untraced
    assert "CACHEFLEET_OTLP_ENDPOINT" not in sidecar_env(raw)
