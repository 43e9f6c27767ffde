"""The API server's ``x-kubernetes-validations`` step, with a real CEL implementation.

A real API server compiles every rule of a CRD and, on create and update,
evaluates each one at every node of the object its schema sits on, with
``self`` the node's value typed by the schema (``number`` is always a
double, ``integer`` an int) and ``oldSelf`` the previous value for
transition rules (those run on update only, where an old value exists).
This module does the same with ``cel-python`` (celpy) on the generated CRDs,
so the rules are checked as written, not through a Python copy of them.

What cel-python lacks is Kubernetes' CEL list library; the one function of
it the CRDs use, ``sum()``, is supplied here (over a list of doubles, as the
rules use it; an empty list sums to 0.0, the zero of the list's type).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import celpy
import yaml
from celpy import celtypes

ROOT = Path(__file__).resolve().parents[2]


def crd_schema(plural: str) -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / f"{plural}.cachefleet.io.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def _k8s_sum(values: Any) -> Any:
    total: Any = celtypes.DoubleType(0.0)
    for value in values:
        total = total + value
    return total


FUNCTIONS = {"sum": _k8s_sum}


def to_cel(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` as CEL sees it under ``schema`` (numbers typed by the schema, not the JSON)."""
    kind = schema.get("type")
    if value is None:
        return None
    if kind == "object" or isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties") or {}
        return celtypes.MapType(
            {
                celtypes.StringType(k): to_cel(v, props.get(k, extra if extra else {}))
                for k, v in value.items()
            }
        )
    if kind == "array" or isinstance(value, list):
        return celtypes.ListType([to_cel(v, schema.get("items", {})) for v in value])
    if kind == "number":
        return celtypes.DoubleType(float(value))
    if kind == "integer":
        return celtypes.IntType(int(value))
    if kind == "boolean" or isinstance(value, bool):
        return celtypes.BoolType(bool(value))
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    return celtypes.StringType(str(value))


@dataclass(frozen=True)
class Rule:
    path: str  # JSON path of the schema node, e.g. ".spec.tenants[*]"
    rule: str
    message: str
    field_path: str | None

    @property
    def transition(self) -> bool:
        return "oldSelf" in self.rule


def rules(schema: dict[str, Any], path: str = "") -> Iterator[Rule]:
    for item in schema.get("x-kubernetes-validations", []):
        yield Rule(path, item["rule"], item["message"], item.get("fieldPath"))
    for name, sub in schema.get("properties", {}).items():
        yield from rules(sub, f"{path}.{name}")
    if "items" in schema:
        yield from rules(schema["items"], f"{path}[*]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from rules(schema["additionalProperties"], f"{path}{{*}}")


def _nodes(
    value: Any, old: Any, schema: dict[str, Any], path: str
) -> Iterator[tuple[str, str, Any, Any, dict[str, Any]]]:
    """(schema path, concrete path, value, old value, schema) of every node present."""
    yield path, path, value, old, schema
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                old_sub = old.get(name) if isinstance(old, dict) else None
                for sp, cp, v, o, s in _nodes(value[name], old_sub, sub, f"{path}.{name}"):
                    yield sp, cp, v, o, s
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            # list-type map items correlate by key; our lists are keyed by name
            old_item = None
            if isinstance(old, list) and isinstance(item, dict) and "name" in item:
                old_item = next((o for o in old if o.get("name") == item["name"]), None)
            for sp, cp, v, o, s in _nodes(item, old_item, schema["items"], f"{path}[*]"):
                yield sp, cp.replace(f"{path}[*]", f"{path}[{i}]", 1), v, o, s


_COMPILED: dict[str, Any] = {}


def program(rule: str) -> Any:
    if rule not in _COMPILED:
        env = celpy.Environment()
        _COMPILED[rule] = env.program(env.compile(rule), functions=FUNCTIONS)
    return _COMPILED[rule]


def violations(plural: str, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """``"<path>: <message>"`` for every rule the object breaks, as an API server reports.

    A rule that cannot be evaluated (no such key, no overload) is reported
    too, with the evaluation error: a real API server refuses the object then.
    """
    schema = crd_schema(plural)
    out: list[str] = []
    for schema_path, concrete, value, old_value, node in _nodes(obj, old, schema, ""):
        for item in node.get("x-kubernetes-validations", []):
            rule = Rule(schema_path, item["rule"], item["message"], item.get("fieldPath"))
            activation = {"self": to_cel(value, node)}
            if rule.transition:
                if old_value is None:
                    continue
                activation["oldSelf"] = to_cel(old_value, node)
            where = concrete + (rule.field_path or "")
            try:
                result = program(rule.rule).evaluate(activation)
            except celpy.CELEvalError as exc:
                out.append(f"{where}: evaluation error: {exc.args[0]}")
                continue
            if isinstance(result, celpy.CELEvalError):
                out.append(f"{where}: evaluation error: {result.args[0]}")
            elif not bool(result):
                out.append(f"{where}: {rule.message}")
    return out
