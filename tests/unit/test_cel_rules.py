"""Every CEL rule of the generated CRDs, evaluated by a real CEL implementation (cel-python).

Good objects pass every rule (including objects that leave optional fields
out: a rule that dereferences a missing field would make a real API server
refuse a valid object); each bad object breaks the rule it targets, with the
message a user would see, and the operator's own parser refuses it with the
same message. Unknown fields: the operator refuses what strict field
validation (kubectl's default) refuses, naming the same field. The chart's
kubeVersion admits only API servers that understand the CRDs.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from cachefleet_operator.api import SpecError, parse_invalidation_spec, parse_spec
from tests.unit.cel_rules import crd_schema, program, rules, violations
from tests.unit.crd_schema import validator_for

ROOT = Path(__file__).resolve().parents[2]
PLURALS = ["inferencecaches", "cacheinvalidations"]


def ic(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "selector": {"matchLabels": {"cachefleet.io/cache": "c"}},
        "model": {"name": "m", "version": "v1"},
        "capacity": {"l1BytesPerPod": 1024, "l2Bytes": 4096},
        "redis": {"url": "redis://127.0.0.1:6379/0"},
        "prometheus": {"url": "http://127.0.0.1:9090"},
    }
    body.update(spec)
    return {
        "apiVersion": "cachefleet.io/v1alpha1",
        "kind": "InferenceCache",
        "metadata": {"name": "c", "namespace": "default"},
        "spec": body,
    }


def cinv(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"cacheRef": {"name": "c"}, "scope": {"type": "Cache"}}
    body.update(spec)
    return {
        "apiVersion": "cachefleet.io/v1alpha1",
        "kind": "CacheInvalidation",
        "metadata": {"name": "i", "namespace": "default"},
        "spec": body,
    }


def all_rules() -> list[tuple[str, str]]:
    return [(p, r.rule) for p in PLURALS for r in rules(crd_schema(p))]


@pytest.mark.parametrize(("plural", "rule"), all_rules())
def test_every_rule_compiles(plural: str, rule: str) -> None:
    program(rule)


GOOD = [
    pytest.param("inferencecaches", ic(), id="no-tenants"),
    pytest.param("inferencecaches", ic(tenants=[]), id="empty-tenants"),
    pytest.param("inferencecaches", ic(tenants=[{"name": "a"}]), id="tenant-all-defaults"),
    pytest.param(
        "inferencecaches",
        ic(
            tenants=[
                {"name": "a", "priorityClass": "Guaranteed", "minShare": 0.5, "maxShare": 1},
                {"name": "b", "priorityClass": "Guaranteed", "minShare": 0.5},
                {"name": "c", "priorityClass": "BestEffort", "maxShare": 0.2},
            ]
        ),
        id="guaranteed-sum-exactly-1",
    ),
    pytest.param("inferencecaches", ic(redis={"secretRef": {"name": "s"}}), id="redis-secret"),
    pytest.param("inferencecaches", ic(routing={}), id="routing-empty"),
    pytest.param("inferencecaches", ic(routing={"enabled": True}), id="routing-rendered-pool"),
    pytest.param(
        "inferencecaches",
        ic(routing={"enabled": True, "inferencePoolRef": {"name": "llama-pool"}}),
        id="routing-existing-pool",
    ),
    pytest.param("cacheinvalidations", cinv(), id="cache-scope"),
    pytest.param(
        "cacheinvalidations", cinv(scope={"type": "Tenant", "tenant": "a"}), id="tenant-scope"
    ),
    pytest.param("cacheinvalidations", cinv(scope={"type": "Model", "model": "m"}), id="model"),
    pytest.param(
        "cacheinvalidations",
        cinv(scope={"type": "Namespace", "tenant": "a", "namespace": "kb-1"}),
        id="namespace-scope",
    ),
    pytest.param("cacheinvalidations", cinv(scope={"type": "Key", "key": "0f" * 32}), id="key"),
    pytest.param(
        "cacheinvalidations",
        cinv(scope={"type": "Key", "key": "0f" * 32, "tenant": "a"}),
        id="key-of-one-tenant",
    ),
    pytest.param(
        "inferencecaches",
        ic(namespaceHeader="X-KB", warmup={"bytes": 1 << 20, "timeoutSeconds": 5}),
        id="namespace-header-and-warmup",
    ),
]


@pytest.mark.parametrize(("plural", "obj"), GOOD)
def test_good_objects_pass_every_rule(plural: str, obj: dict[str, Any]) -> None:
    assert violations(plural, obj) == []
    assert violations(plural, obj, old=copy.deepcopy(obj)) == []  # an update that changes nothing
    parse = parse_spec if plural == "inferencecaches" else parse_invalidation_spec
    parse(obj["spec"])


def test_the_shipped_examples_pass_every_rule() -> None:
    for path, plural in [
        ("examples/inferencecache.yaml", "inferencecaches"),
        ("examples/cacheinvalidation.yaml", "cacheinvalidations"),
    ]:
        for obj in yaml.safe_load_all((ROOT / path).read_text()):
            if obj:
                assert violations(plural, obj) == [], path


BAD = [
    pytest.param(
        "inferencecaches",
        ic(tenants=[{"name": "a", "minShare": 0.6, "maxShare": 0.5}]),
        ".spec.tenants[0].minShare: minShare must not exceed maxShare",
        id="min-over-max",
    ),
    pytest.param(
        "inferencecaches",
        ic(tenants=[{"name": "a", "priorityClass": "BestEffort", "minShare": 0.1}]),
        ".spec.tenants[0].minShare: a BestEffort tenant has no floor: minShare must be 0",
        id="best-effort-floor",
    ),
    pytest.param(
        "inferencecaches",
        ic(
            tenants=[
                {"name": "a", "priorityClass": "Guaranteed", "minShare": 0.6},
                {"name": "b", "priorityClass": "Guaranteed", "minShare": 0.5},
            ]
        ),
        ".spec.tenants: the minShare of all Guaranteed tenants must sum to at most 1",
        id="guaranteed-sum",
    ),
    pytest.param(
        "inferencecaches",
        ic(tenants=[{"name": "a", "minShare": 0.6}, {"name": "b", "minShare": 0.5}]),
        ".spec.tenants: the minShare of all tenants must sum to at most 1",
        id="all-min-sum",
    ),
    pytest.param(
        "inferencecaches",
        ic(redis={"url": "redis://x:1/0", "secretRef": {"name": "s"}}),
        ".spec.redis: set exactly one of url and secretRef",
        id="redis-both",
    ),
    pytest.param(
        "inferencecaches",
        ic(redis={}),
        ".spec.redis: set exactly one of url and secretRef",
        id="redis-neither",
    ),
    pytest.param(
        "inferencecaches",
        ic(routing={"inferencePoolRef": {"name": "llama-pool"}}),
        ".spec.routing.inferencePoolRef: inferencePoolRef needs enabled: true",
        id="pool-ref-without-enabled",
    ),
    pytest.param(
        "inferencecaches",
        ic(routing={"enabled": False, "inferencePoolRef": {"name": "llama-pool"}}),
        ".spec.routing.inferencePoolRef: inferencePoolRef needs enabled: true",
        id="pool-ref-disabled",
    ),
    pytest.param(
        "cacheinvalidations",
        cinv(scope={"type": "Tenant"}),
        ".spec.scope.tenant: scope Tenant needs tenant",
        id="tenant-scope-no-tenant",
    ),
    pytest.param(
        "cacheinvalidations",
        cinv(scope={"type": "Model"}),
        ".spec.scope.model: scope Model needs model",
        id="model-scope-no-model",
    ),
    pytest.param(
        "cacheinvalidations",
        cinv(scope={"type": "Namespace", "tenant": "a"}),
        ".spec.scope.namespace: scope Namespace needs tenant and namespace",
        id="namespace-scope-no-namespace",
    ),
    pytest.param(
        "cacheinvalidations",
        cinv(scope={"type": "Key", "tenant": "a"}),
        ".spec.scope.key: scope Key needs key (the X-Cache-Key of a hit)",
        id="key-scope-no-key",
    ),
]


BAD_FIELDS = [
    pytest.param(cinv(scope={"type": "Key", "key": "F0" * 32}), "spec.scope.key", id="upper-hex"),
    pytest.param(cinv(scope={"type": "Key", "key": "0f" * 16}), "spec.scope.key", id="short"),
    pytest.param(
        cinv(scope={"type": "Namespace", "tenant": "a", "namespace": "kb/1"}),
        "spec.scope.namespace",
        id="namespace-with-slash",
    ),
]


@pytest.mark.parametrize(("obj", "field"), BAD_FIELDS)
def test_bad_digest_or_namespace_is_refused_naming_the_field(
    obj: dict[str, Any], field: str
) -> None:
    errors = list(validator_for("cacheinvalidations").iter_errors(obj))
    assert [_schema_path(e) for e in errors] == [field], errors
    with pytest.raises(SpecError) as info:
        parse_invalidation_spec(obj["spec"])
    assert info.value.field == field


@pytest.mark.parametrize(("plural", "obj", "expected"), BAD)
def test_bad_objects_break_their_rule_and_the_operator_agrees(
    plural: str, obj: dict[str, Any], expected: str
) -> None:
    found = violations(plural, obj)
    assert expected in found, found
    message = expected.split(": ", 1)[1]
    parse = parse_spec if plural == "inferencecaches" else parse_invalidation_spec
    with pytest.raises(SpecError) as info:
        parse(obj["spec"])
    assert info.value.message == message


def test_every_rule_has_a_bad_object() -> None:
    hit = {str(p.values[2]).split(": ", 1)[1] for p in BAD}
    hit.add("a CacheInvalidation is one-shot: its spec is immutable")  # tested below
    declared = {r.message for p in PLURALS for r in rules(crd_schema(p))}
    assert declared == hit


def test_invalidation_spec_is_immutable_on_update() -> None:
    old = cinv()
    new = cinv(scope={"type": "Tenant", "tenant": "a"})
    assert violations("cacheinvalidations", new, old=old) == [
        ".spec: a CacheInvalidation is one-shot: its spec is immutable"
    ]
    assert violations("cacheinvalidations", new) == []  # a create has no oldSelf


def test_a_rule_without_has_would_refuse_a_valid_object() -> None:
    """The harness catches the original defect: ``self.tenants`` with no tenants."""
    naive = "self.tenants.map(t, has(t.minShare) ? t.minShare : 0.0).sum() <= 1.0"
    from tests.unit.cel_rules import to_cel

    schema = crd_schema("inferencecaches")["properties"]["spec"]
    with pytest.raises(celpy.CELEvalError, match="tenants"):
        program(naive).evaluate({"self": to_cel(ic()["spec"], schema)})


# --------------------------------------------------------- strict field validation

UNKNOWN = [
    pytest.param(ic(foo=1), "spec.foo", id="top"),
    pytest.param(
        ic(tenants=[{"name": "a", "sla": {"p95": 1}}]), "spec.tenants[0].sla.p95", id="sla"
    ),
    pytest.param(
        ic(capacity={"l1_bytes_per_pod": 1, "l2Bytes": 1}),
        "spec.capacity.l1_bytes_per_pod",
        id="snake-case-is-unknown-on-the-wire",
    ),
    pytest.param(
        ic(redis={"url": "redis://x:1/0", "password": "p"}), "spec.redis.password", id="redis"
    ),
    pytest.param(
        ic(routing={"enabled": True, "targetPort": 8080}), "spec.routing.targetPort", id="routing"
    ),
]


def _schema_path(error: Any) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".")


@pytest.mark.parametrize(("obj", "field"), UNKNOWN)
def test_unknown_fields_are_refused_by_schema_and_operator(obj: dict[str, Any], field: str) -> None:
    errors = list(validator_for("inferencecaches").iter_errors(obj))
    unknown = [e for e in errors if e.validator == "additionalProperties"]
    assert unknown, errors
    names = re.findall(r"'([^']+)' was unexpected", unknown[0].message)
    assert f"{_schema_path(unknown[0])}.{names[0]}" == field
    with pytest.raises(SpecError) as info:
        parse_spec(obj["spec"])
    assert (info.value.field, info.value.message) == (field, "unknown field")


# ------------------------------------------------------------------------ versions


def _uses_field_path(schema: dict[str, Any]) -> bool:
    return any(r.field_path for r in rules(schema))


def test_chart_kube_version_admits_only_servers_that_understand_the_crds() -> None:
    chart = yaml.safe_load((ROOT / "charts" / "cachefleet" / "Chart.yaml").read_text())
    match = re.match(r">=\s*1\.(\d+)", chart["kubeVersion"])
    assert match, chart["kubeVersion"]
    minimum = int(match.group(1))
    # fieldPath in x-kubernetes-validations: 1.28; CEL list sum(): 1.27 (library "lists")
    needed = 28 if any(_uses_field_path(crd_schema(p)) for p in PLURALS) else 27
    assert minimum >= needed
