"""Turn a generated CRD's structural schema into a JSON schema jsonschema can check.

``nullable`` becomes a ``null`` type, ``x-kubernetes-int-or-string`` an
integer-or-string, boolean exclusive bounds Draft 4 keep as they are, and
objects with ``properties`` refuse unknown fields (like ``kubectl apply``
with strict field validation). CEL rules are not evaluated here; the tests
check the same rules through the pydantic models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]


def to_json_schema(node: Any) -> Any:
    if isinstance(node, list):
        return [to_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            out[key] = {k: to_json_schema(v) for k, v in value.items()}
        else:
            out[key] = to_json_schema(value)
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in out:
        out["type"] = (
            [out["type"], "null"] if isinstance(out["type"], str) else [*out["type"], "null"]
        )
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validator_for(kind_plural: str) -> jsonschema.Draft4Validator:
    crd = yaml.safe_load((ROOT / "crds" / f"{kind_plural}.cachefleet.io.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    converted = to_json_schema(schema)
    converted["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft4Validator(converted)


def spec_errors(raw_spec: dict[str, Any], sep: str = ".") -> list[str]:
    """The paths (joined by ``sep``) the InferenceCache schema refuses in an object
    with ``raw_spec``."""
    obj = {
        "apiVersion": "cachefleet.io/v1alpha1",
        "kind": "InferenceCache",
        "metadata": {"name": "chat"},
        "spec": raw_spec,
    }
    return [
        sep.join(str(p) for p in err.absolute_path)
        for err in validator_for("inferencecaches").iter_errors(obj)
    ]
