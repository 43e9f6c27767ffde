"""ttlSeconds, cacheControl and savings in the InferenceCache: CRD -> quota table -> status.

The fields are checked the two ways a user meets them: the API server's
schema (the generated CRD) and the operator's own parse, each naming the
field; the savings the operator writes to the status (the SAVED column)
come from Prometheus answers shaped as the sidecars' metrics make them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachefleet_common.contract.messages import QuotaAssignment
from cachefleet_operator.allocation import allocate
from cachefleet_operator.api import SpecError, parse_spec
from cachefleet_operator.assignment import build_assignment, demands_from_spec
from cachefleet_operator.cache_status import saved_model_hours, savings_status
from cachefleet_operator.crdgen import inference_cache_crd
from cachefleet_operator.metrics_source import savings_from

from .crd_schema import spec_errors

EXAMPLE = Path(__file__).parents[2] / "examples" / "inferencecache.yaml"


def spec() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["spec"])


def table(raw: dict[str, Any]) -> QuotaAssignment:
    parsed = parse_spec(raw)
    allocation = allocate(demands_from_spec(parsed), {}, None, 1 << 30, 1 << 34)
    return build_assignment(parsed, allocation)


def schema_errors(raw_spec: dict[str, Any]) -> list[str]:
    return spec_errors(raw_spec, sep="/")


def test_ttl_and_cache_control_reach_the_quota_table() -> None:
    raw = spec()
    first, second = raw["tenants"][0]["name"], raw["tenants"][1]["name"]
    raw["ttlSeconds"] = 3600
    raw["tenants"][0]["ttlSeconds"] = 60
    raw["tenants"][0]["cacheControl"] = {"allowBypass": False}
    assert schema_errors(raw) == []
    assignment = table(raw)
    assert assignment.ttl_seconds == 3600  # tenants the table does not list
    one, two = assignment.tenants[first], assignment.tenants[second]
    assert (one.ttl_seconds, one.allow_bypass, one.allow_max_age) == (60, False, None)
    assert (two.ttl_seconds, two.allow_bypass, two.allow_max_age) == (3600, None, None)


def test_nothing_set_means_no_ttl_and_every_directive_allowed() -> None:
    assignment = table(spec())
    assert assignment.ttl_seconds is None
    for quota in assignment.tenants.values():
        assert (quota.ttl_seconds, quota.allow_bypass, quota.allow_max_age) == (None, None, None)


@pytest.mark.parametrize(
    ("where", "value", "field"),
    [
        ("tenant", {"ttlSeconds": 0}, "ttlSeconds"),
        ("tenant", {"ttlSeconds": "1h"}, "ttlSeconds"),
        ("tenant", {"cacheControl": {"allowBypass": "sometimes"}}, "allowBypass"),
        ("tenant", {"cacheControl": {"allowMaxAge": 1, "noSuch": True}}, "cacheControl"),
        ("spec", {"ttlSeconds": -5}, "ttlSeconds"),
    ],
)
def test_bad_freshness_fields_are_refused_naming_the_field(
    where: str, value: dict[str, Any], field: str
) -> None:
    raw = spec()
    (raw["tenants"][0] if where == "tenant" else raw).update(value)
    with pytest.raises(SpecError, match=field):
        parse_spec(raw)
    assert schema_errors(raw), "the API server's schema lets it through"


def test_the_saved_printer_column_reads_the_status_field_the_operator_writes() -> None:
    version = inference_cache_crd()["spec"]["versions"][0]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["Saved"]["jsonPath"] == ".status.savedModelHours"
    assert columns["Saved"]["type"] == "number"
    status_props = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert "savedModelHours" in status_props
    assert {"modelSeconds", "promptTokens", "completionTokens", "cost"} <= set(
        status_props["savings"]["properties"]
    )


def sample(value: float, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [0, str(value)]}


def test_savings_from_prometheus_answers_to_the_status() -> None:
    found = savings_from(
        [sample(5400.0, tenant="acme"), sample(1800.0, tenant="bolt")],
        [
            sample(1000, tenant="acme", kind="prompt"),
            sample(250, tenant="acme", kind="completion"),
            sample(7, tenant="bolt", kind="weird"),
        ],
        [sample(0.42, tenant="acme")],
    )
    assert found == {
        "acme": {
            "model_seconds": 5400.0,
            "prompt_tokens": 1000.0,
            "completion_tokens": 250.0,
            "cost": 0.42,
        },
        "bolt": {"model_seconds": 1800.0},
    }
    assert saved_model_hours(found) == 2.0
    assert saved_model_hours({"a": {"model_seconds": 18.0}}) == 0.005  # a short run still shows
    assert saved_model_hours(None) is None
    total = savings_status(found.values()).wire()
    assert total == {
        "modelSeconds": 7200.0,
        "promptTokens": 1000,
        "completionTokens": 250,
        "cost": 0.42,
    }
    assert "cost" not in savings_status([found["bolt"]]).wire()  # unpriced: not 0


def test_prices_in_the_spec_are_checked_by_the_schema_and_the_operator_naming_the_field() -> None:
    raw = spec()
    raw["savings"] = {
        "currency": "USD",
        "prices": [
            {"model": "meta-llama/Llama-3.1-8B-Instruct", "promptPer1k": 0.0002},
            {"model": "*", "promptPer1k": 0.0005, "completionPer1k": 0.0015},
        ],
    }
    assert schema_errors(raw) == []
    parsed = parse_spec(raw)
    assert parsed.savings is not None
    assert parsed.savings.price_table() == {
        "meta-llama/Llama-3.1-8B-Instruct": (0.0002, 0.0),
        "*": (0.0005, 0.0015),
    }
    for prices, field, message in (
        ([{"model": "m", "promptPer1k": -1}], "spec.savings.prices[0].promptPer1k", "0"),
        (
            [{"model": "m", "completionPer1k": "a lot"}],
            "spec.savings.prices[0].completionPer1k",
            "",
        ),
        ([{"model": ""}], "spec.savings.prices[0].model", "at least 1"),
        ([{"promptPer1k": 1}], "spec.savings.prices[0].model", "required"),
        ([{"model": "m", "prompt": 1}], "spec.savings.prices[0].prompt", "unknown field"),
        ([{"model": "m"}, {"model": "m"}], "spec.savings", "model 'm' is priced twice"),
    ):
        bad = copy.deepcopy(raw)
        bad["savings"]["prices"] = prices
        with pytest.raises(SpecError) as err:
            parse_spec(bad)
        assert err.value.field == field
        assert message in err.value.message
        if field != "spec.savings":  # uniqueness is the list-map's, enforced by the API server
            assert any(path.startswith("spec/savings/prices/0") for path in schema_errors(bad))
    bad = copy.deepcopy(raw)
    bad["savings"]["currency"] = "US dollars"
    with pytest.raises(SpecError) as err:
        parse_spec(bad)
    assert err.value.field == "spec.savings.currency"
    assert schema_errors(bad) == ["spec/savings/currency"]


def test_the_cost_in_status_carries_the_spec_currency_and_none_without_a_cost() -> None:
    priced = savings_status([{"model_seconds": 3.0, "cost": 0.25}], "EUR").wire()
    assert (priced["cost"], priced["currency"]) == (0.25, "EUR")
    unpriced = savings_status([{"model_seconds": 3.0}], "EUR").wire()
    assert "cost" not in unpriced
    assert "currency" not in unpriced
