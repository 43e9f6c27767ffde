"""The tenant's ``semantic`` field: CRD model -> quota table -> sidecar options."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachefleet_operator.allocation import allocate
from cachefleet_operator.api import SpecError, parse_spec
from cachefleet_operator.assignment import build_assignment, demands_from_spec

EXAMPLE = Path(__file__).parents[2] / "examples" / "inferencecache.yaml"


def spec() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["spec"])


def test_semantic_settings_reach_the_quota_table() -> None:
    parsed = parse_spec(spec())
    allocation = allocate(demands_from_spec(parsed), {}, None, 1 << 30, 1 << 34)
    tenants = build_assignment(parsed, allocation).tenants
    assert tenants["acme-support"].semantic is True
    assert tenants["acme-support"].semantic_threshold == 0.85
    # No semantic block: the sidecar's default (off unless --semantic-default-on).
    assert tenants["search-assistant"].semantic is None
    assert tenants["search-assistant"].semantic_threshold is None


@pytest.mark.parametrize("threshold", [0, 1.5, "high"])
def test_a_bad_threshold_is_refused_naming_the_field(threshold: Any) -> None:
    raw = spec()
    raw["tenants"][0]["semantic"] = {"enabled": True, "threshold": threshold}
    with pytest.raises(SpecError, match="threshold"):
        parse_spec(raw)


def test_shadow_mode_reaches_the_quota_table_and_empty_means_the_sidecar_default() -> None:
    raw = spec()
    raw["tenants"][0]["semantic"] = {"enabled": True, "shadow": True}
    parsed = parse_spec(raw)
    allocation = allocate(demands_from_spec(parsed), {}, None, 1 << 30, 1 << 34)
    tenants = build_assignment(parsed, allocation).tenants
    first = raw["tenants"][0]["name"]
    assert (tenants[first].semantic, tenants[first].semantic_shadow) == (True, True)
    assert tenants["search-assistant"].semantic_shadow is None
    raw["tenants"][0]["semantic"] = {"enabled": True, "shadow": "sometimes"}
    with pytest.raises(SpecError, match="shadow"):
        parse_spec(raw)
