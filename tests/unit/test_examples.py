"""The examples/ manifests are valid against the generated CRDs and the models."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from cachefleet_operator.allocation import PriorityClass
from cachefleet_operator.api import (
    CacheInvalidation,
    InferenceCache,
    SpecError,
    parse_spec,
)

from .crd_schema import ROOT, validator_for


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())  # type: ignore[no-any-return]


def test_inference_cache_example_is_valid_with_one_tenant_per_class() -> None:
    doc = load("inferencecache.yaml")
    errors = list(validator_for("inferencecaches").iter_errors(doc))
    assert errors == []
    cache = InferenceCache.model_validate(doc)
    assert {t.priority_class for t in cache.spec.tenants} == set(PriorityClass)


def test_cache_invalidation_example_is_valid() -> None:
    doc = load("cacheinvalidation.yaml")
    assert list(validator_for("cacheinvalidations").iter_errors(doc)) == []
    inv = CacheInvalidation.model_validate(doc)
    assert inv.spec.scope.tenant == "acme-support"


@pytest.mark.parametrize("name", ["purge-key.yaml", "invalidate-namespace.yaml"])
def test_key_and_namespace_examples_are_valid(name: str) -> None:
    doc = load(name)
    assert list(validator_for("cacheinvalidations").iter_errors(doc)) == []
    assert CacheInvalidation.model_validate(doc).spec.scope.type.value in ("Key", "Namespace")


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda s: s["tenants"][0].update(priorityClass="Gold"), "priorityClass"),
        (lambda s: s["tenants"][1].update(minShare=-0.1), "minShare"),
        (lambda s: s["capacity"].update(l1BytesPerPod=-1), "l1BytesPerPod"),
        (lambda s: s.update(rebalanceIntervalSeconds=0), "rebalanceIntervalSeconds"),
        (lambda s: s["tenants"][0].update(maxShares=0.5), "maxShares"),
    ],
)
def test_schema_rejects_bad_fields(mutate: Any, field: str) -> None:
    doc = copy.deepcopy(load("inferencecache.yaml"))
    mutate(doc["spec"])
    errors = list(validator_for("inferencecaches").iter_errors(doc))
    assert errors, f"{field} accepted"
    assert any(field in str(e.message) + str(list(e.path)) for e in errors)


@pytest.mark.parametrize(
    ("mutate", "field", "message"),
    [
        (
            lambda s: s["tenants"][1].update(minShare=0.7, maxShare=0.6),
            "spec.tenants[1]",
            "minShare must not exceed maxShare",
        ),
        (
            lambda s: s["tenants"][1].update(minShare=0.65, maxShare=0.9),
            "spec",
            "must sum to at most 1",
        ),
        (lambda s: s["tenants"][2].update(minShare=0.1), "spec.tenants[2]", "BestEffort"),
        (
            lambda s: s["tenants"].append(dict(s["tenants"][0])),
            "spec",
            "listed twice",
        ),
        (lambda s: s["redis"].update(url="redis://r:6379"), "spec.redis", "exactly one"),
    ],
)
def test_cross_field_rules_name_the_field(mutate: Any, field: str, message: str) -> None:
    spec = copy.deepcopy(load("inferencecache.yaml")["spec"])
    mutate(spec)
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    assert info.value.field == field
    assert message in info.value.message
