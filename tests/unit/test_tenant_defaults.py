"""spec.tenantDefaults: validation (models and CRD schema) and what the operator publishes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachefleet_common.contract.lua import DEFAULT_GUEST_MAX_SHARE
from cachefleet_common.contract.messages import QuotaAssignment
from cachefleet_common.contract.names import Policy
from cachefleet_operator.allocation import allocate
from cachefleet_operator.api import (
    SpecError,
    listed_l1_bytes,
    listed_l2_bytes,
    parse_spec,
    unlisted_l1_bytes,
    unlisted_l2_bytes,
)
from cachefleet_operator.assignment import assignment_digest, build_assignment, demands_from_spec

from .crd_schema import spec_errors

EXAMPLE = Path(__file__).parents[2] / "examples" / "inferencecache.yaml"


def spec(**defaults: Any) -> dict[str, Any]:
    raw: dict[str, Any] = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["spec"])
    if defaults:
        raw["tenantDefaults"] = defaults
    return raw


def schema_errors(raw_spec: dict[str, Any]) -> list[str]:
    return spec_errors(raw_spec)


def test_defaults_are_optional_and_filled_in() -> None:
    assert parse_spec(spec()).tenant_defaults is None
    parsed = parse_spec(spec(policy="sits"))
    assert parsed.tenant_defaults is not None
    assert parsed.tenant_defaults.share == 0.1
    assert parsed.tenant_defaults.l2_share == 0.1
    assert parsed.tenant_defaults.l2_guest_max_share == DEFAULT_GUEST_MAX_SHARE
    assert parsed.tenant_defaults.priority_class == "Standard"
    assert parsed.tenant_defaults.policy is Policy.SITS
    assert schema_errors(spec(share=0.25, priorityClass="BestEffort", policy="lirs")) == []
    assert schema_errors(spec(l2Share=0)) == []
    assert schema_errors(spec(l2GuestMaxShare=1)) == []


@pytest.mark.parametrize(
    ("defaults", "field"),
    [
        ({"share": 0}, "share"),
        ({"share": 0.95}, "share"),
        ({"share": "most"}, "share"),
        ({"l2Share": -0.1}, "l2Share"),
        ({"l2Share": 0.95}, "l2Share"),
        ({"l2Share": "half"}, "l2Share"),
        ({"l2GuestMaxShare": 0}, "l2GuestMaxShare"),
        ({"l2GuestMaxShare": 1.5}, "l2GuestMaxShare"),
        ({"l2GuestMaxShare": "half"}, "l2GuestMaxShare"),
        ({"priorityClass": "Guaranteed"}, "priorityClass"),
        ({"policy": "fifo"}, "policy"),
        ({"ttl": 5}, "ttl"),
    ],
)
def test_bad_defaults_are_refused_naming_the_field(defaults: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(spec(**defaults))
    assert caught.value.field == f"spec.tenantDefaults.{field}"
    if field != "ttl":  # an unknown field: refused by the API server's strict field validation
        assert f"spec.tenantDefaults.{field}" in schema_errors(spec(**defaults))


def test_the_list_limit_stays() -> None:
    raw = spec(share=0.2)
    raw["tenants"] = [{"name": f"t{i}"} for i in range(1001)]
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)
    assert caught.value.field == "spec.tenants"


def test_the_operator_publishes_the_defaults_and_the_pool_comes_off_the_listed_tenants() -> None:
    parsed = parse_spec(
        spec(
            share=0.25, l2Share=0.5, l2GuestMaxShare=0.1, priorityClass="BestEffort", policy="lirs"
        )
    )
    capacity = parsed.capacity.l1_bytes_per_pod
    l2 = parsed.capacity.l2_bytes
    assert unlisted_l1_bytes(parsed) == capacity // 4
    assert listed_l1_bytes(parsed) == capacity - capacity // 4
    assert (unlisted_l2_bytes(parsed), listed_l2_bytes(parsed)) == (l2 // 2, l2 - l2 // 2)
    allocation = allocate(
        demands_from_spec(parsed), {}, None, listed_l1_bytes(parsed), listed_l2_bytes(parsed)
    )
    assignment = build_assignment(parsed, allocation)
    unlisted = assignment.default_tenant
    assert unlisted is not None
    assert (unlisted.l1_bytes, unlisted.l2_bytes) == (capacity // 4, l2 // 2)
    assert (unlisted.policy, unlisted.priority_class) == (Policy.LIRS, "BestEffort")
    assert unlisted.l2_guest_max_share == 0.1
    assert {q.l2_guest_max_share for q in assignment.tenants.values()} == {None}
    listed = sum(q.l1_bytes for q in assignment.tenants.values())
    assert listed + unlisted.l1_bytes <= capacity
    assert sum(q.l2_bytes for q in assignment.tenants.values()) + unlisted.l2_bytes <= l2
    # The sidecars read it back from the wire.
    again = QuotaAssignment.model_validate_json(assignment.model_dump_json())
    assert again.default_tenant == unlisted


def test_without_defaults_nothing_changes_for_existing_caches() -> None:
    parsed = parse_spec(spec())
    assert unlisted_l1_bytes(parsed) == 0
    allocation = allocate(
        demands_from_spec(parsed), {}, None, listed_l1_bytes(parsed), parsed.capacity.l2_bytes
    )
    assignment = build_assignment(parsed, allocation)
    assert assignment.default_tenant is None
    with_defaults = build_assignment(parse_spec(spec(share=0.2)), allocation)
    assert assignment_digest(with_defaults) != assignment_digest(assignment)
    # a new guest cap is a new table for the sidecars
    capped = build_assignment(parse_spec(spec(share=0.2, l2GuestMaxShare=0.5)), allocation)
    assert assignment_digest(capped) != assignment_digest(with_defaults)


def test_with_no_tenant_listed_the_pool_is_the_whole_l1() -> None:
    raw = spec(share=0.2)
    raw["tenants"] = []
    parsed = parse_spec(raw)
    assert unlisted_l1_bytes(parsed) == parsed.capacity.l1_bytes_per_pod
    assert listed_l1_bytes(parsed) == 0
    assert unlisted_l2_bytes(parsed) == parsed.capacity.l2_bytes
    assert listed_l2_bytes(parsed) == 0


def test_an_l2_share_of_zero_keeps_the_unlisted_tenants_in_l1() -> None:
    parsed = parse_spec(spec(l2Share=0))
    assert (unlisted_l2_bytes(parsed), listed_l2_bytes(parsed)) == (0, parsed.capacity.l2_bytes)
    allocation = allocate(demands_from_spec(parsed), {}, None, listed_l1_bytes(parsed), 0)
    unlisted = build_assignment(parsed, allocation).default_tenant
    assert unlisted is not None
    assert unlisted.l2_bytes == 0
