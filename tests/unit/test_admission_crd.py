"""Fair queuing and GIE objectives in the CRD: spec -> quota table -> what old peers read."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachefleet_common.contract.messages import QuotaAssignment
from cachefleet_operator.allocation import allocate
from cachefleet_operator.api import SpecError, parse_spec
from cachefleet_operator.assignment import assignment_digest, build_assignment, demands_from_spec

from .crd_schema import spec_errors

EXAMPLE = Path(__file__).parents[2] / "examples" / "inferencecache.yaml"
#: The example's quota digest before fairness weights and objectives existed (with and
#: without tenantDefaults): an upgrade must not move every cache's quota generation.
DIGEST_BEFORE = "446332844d7bdc18"
DIGEST_BEFORE_DEFAULTS = "9137e15e53dc1a19"


def spec() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["spec"])


def assignment(raw: dict[str, Any]) -> QuotaAssignment:
    parsed = parse_spec(raw)
    allocation = allocate(demands_from_spec(parsed), {}, None, 1 << 30, 1 << 34)
    return build_assignment(parsed, allocation)


def test_weights_and_objectives_reach_the_quota_table() -> None:
    raw = spec()
    first = raw["tenants"][0]["name"]
    raw["tenants"][0]["fairnessWeight"] = 3
    raw["tenantDefaults"] = {"fairnessWeight": 0.5}
    raw["objectives"] = [
        {"name": "batch", "priorityClass": "BestEffort"},
        {"name": "chat", "priorityClass": "Guaranteed"},
    ]
    assert spec_errors(raw) == []
    table = assignment(raw)
    assert table.tenants[first].fairness_weight == 3
    others = [q.fairness_weight for name, q in table.tenants.items() if name != first]
    assert others
    assert all(w is None for w in others)
    assert table.default_tenant is not None
    assert table.default_tenant.fairness_weight == 0.5
    assert table.objectives == {"batch": "BestEffort", "chat": "Guaranteed"}
    # an old sidecar's model (extra fields ignored) still reads the table
    assert QuotaAssignment.model_validate_json(table.model_dump_json()).objectives == {
        "batch": "BestEffort",
        "chat": "Guaranteed",
    }
    # a table from an old operator has neither: every weight 1, no objectives
    old = QuotaAssignment.model_validate(
        {"generation": 3, "tenants": {"a": {"l1_bytes": 1, "l2_bytes": 0}}}
    )
    assert old.tenants["a"].fairness_weight is None
    assert old.objectives == {}


def test_the_digest_is_unchanged_while_nothing_uses_them() -> None:
    assert assignment_digest(assignment(spec())) == DIGEST_BEFORE
    raw = spec()
    raw["tenantDefaults"] = {}
    assert assignment_digest(assignment(raw)) == DIGEST_BEFORE_DEFAULTS
    raw["objectives"] = [{"name": "batch", "priorityClass": "BestEffort"}]
    assert assignment_digest(assignment(raw)) != DIGEST_BEFORE_DEFAULTS
    raw = spec()
    raw["tenants"][0]["fairnessWeight"] = 2
    assert assignment_digest(assignment(raw)) != DIGEST_BEFORE


@pytest.mark.parametrize("weight", [0, -1, 1001, "heavy"])
def test_a_bad_weight_is_refused_by_the_model_and_the_schema(weight: Any) -> None:
    raw = spec()
    raw["tenants"][0]["fairnessWeight"] = weight
    assert spec_errors(raw) != []
    with pytest.raises(SpecError, match="fairnessWeight"):
        parse_spec(raw)


def test_objectives_need_a_known_class_and_unique_names() -> None:
    raw = spec()
    raw["objectives"] = [{"name": "batch", "priorityClass": "Platinum"}]
    assert spec_errors(raw) != []
    with pytest.raises(SpecError, match="priorityClass"):
        parse_spec(raw)
    raw["objectives"] = [
        {"name": "batch", "priorityClass": "BestEffort"},
        {"name": "batch", "priorityClass": "Standard"},
    ]
    with pytest.raises(SpecError, match="objective"):
        parse_spec(raw)
