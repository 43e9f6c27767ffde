"""Byte sizes in the CRDs accept Kubernetes quantities (512Mi) as well as integers."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from cachefleet_operator.allocation import allocate
from cachefleet_operator.api import InferenceCacheSpec, listed_l1_bytes, listed_l2_bytes, parse_spec
from cachefleet_operator.assignment import assignment_digest, build_assignment, demands_from_spec
from cachefleet_operator.injection import cache_flags, cache_info
from cachefleet_operator.quantity import parse_bytes, readable

from .crd_schema import spec_errors

EXAMPLE = Path(__file__).parents[2] / "examples" / "inferencecache.yaml"


def spec() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["spec"])


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("512Mi", 512 << 20),
        ("2Gi", 2 << 30),
        ("1G", 10**9),
        ("1500k", 1_500_000),
        ("1e3", 1000),
        ("+64Ki", 64 << 10),
        ("0", 0),
        ("0.5Gi", 1 << 29),
        (536870912, 536870912),
    ],
)
def test_quantities_and_integers_parse_to_bytes(text: Any, count: int) -> None:
    assert parse_bytes(text) == count


@pytest.mark.parametrize("text", ["512 MB", "lots", "1.5", "100m", "", "Mi", True])
def test_what_is_not_a_whole_byte_quantity_is_refused(text: Any) -> None:
    with pytest.raises(ValueError, match=r"quantity|whole number|byte count"):
        parse_bytes(text)


def test_readable_prints_sizes_back_as_a_user_writes_them() -> None:
    assert readable(512 << 20) == "512Mi"
    assert readable(3 << 30) == "3Gi"
    assert readable(1536 << 10) == "1536Ki"
    assert readable(1000) == "1000"
    assert readable(0) == "0"


def _integers(raw: dict[str, Any]) -> dict[str, Any]:
    raw["capacity"] = {k: parse_bytes(v) for k, v in raw["capacity"].items()}
    raw["warmup"] = {"bytes": 64 << 20}
    return raw


def _quantities(raw: dict[str, Any]) -> dict[str, Any]:
    raw = _integers(raw)
    raw["capacity"] = {k: readable(v) for k, v in raw["capacity"].items()}
    raw["warmup"] = {"bytes": "64Mi"}
    return raw


def test_the_example_writes_its_sizes_as_quantities() -> None:
    assert spec()["capacity"] == {"l1BytesPerPod": "512Mi", "l2Bytes": "16Gi"}


def test_every_size_field_as_a_quantity_validates_against_the_crd_and_the_model() -> None:
    raw = _quantities(spec())
    assert spec_errors(raw) == []
    assert spec_errors(_integers(spec())) == []
    parsed = parse_spec(raw)
    assert parsed.capacity.l1_bytes_per_pod == 512 << 20
    assert parsed.capacity.l2_bytes == 16 << 30
    assert parsed.warmup is not None
    assert parsed.warmup.bytes == 64 << 20


def test_a_quantity_reconciles_to_the_same_quotas_as_the_integer_form() -> None:
    def quotas(raw: dict[str, Any]) -> str:
        parsed: InferenceCacheSpec = parse_spec(raw)
        allocation = allocate(
            demands_from_spec(parsed), {}, None, listed_l1_bytes(parsed), listed_l2_bytes(parsed)
        )
        return assignment_digest(build_assignment(parsed, allocation))

    assert quotas(_quantities(spec())) == quotas(_integers(spec()))


def test_the_injected_sidecar_gets_bytes_from_a_quantity() -> None:
    raw = _quantities(spec())
    info = cache_info({"metadata": {"namespace": "ns", "name": "c"}, "spec": raw})
    assert info.l1_bytes_per_pod == 512 << 20
    assert ("warm-bytes", str(64 << 20)) in cache_flags(raw)


@pytest.mark.parametrize(
    ("field", "value"),
    [("l1BytesPerPod", "512 MB"), ("l2Bytes", "-1Gi"), ("l1BytesPerPod", "1.5")],
)
def test_a_bad_size_is_refused_by_the_schema_or_the_model_naming_the_field(
    field: str, value: str
) -> None:
    raw = spec()
    raw["capacity"][field] = value
    schema = spec_errors(raw)
    try:
        parse_spec(raw)
        model_error = ""
    except (ValidationError, ValueError) as exc:
        model_error = str(exc)
    assert any(field in e for e in schema) or field in model_error
    assert model_error, "the operator itself refuses it too (objects written around the schema)"
