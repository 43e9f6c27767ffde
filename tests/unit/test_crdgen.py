"""CRD generation: committed YAML matches the models, and the schema is structural."""

from __future__ import annotations

from typing import Any

import pytest

from cachefleet_operator import crdgen

from .crd_schema import ROOT


def test_committed_crds_match_the_generator() -> None:
    stale = []
    for rel, text in crdgen.generated_files().items():
        path = ROOT / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(rel)
    assert not stale, f"generated CRDs are stale: {stale}; run `cachefleet crds` and commit"


def walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for name, sub in schema.get("properties", {}).items():
        out += walk(sub, f"{path}.{name}")
    items = schema.get("items")
    if isinstance(items, dict) and items.get("type") == "object":
        out += walk(items, f"{path}[]")
    return out


@pytest.mark.parametrize("name", ["inferencecaches", "cacheinvalidations"])
def test_schema_is_structural_with_status_subresource(name: str) -> None:
    crd = crdgen.all_crds()[f"{name}.cachefleet.io.yaml"]
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    assert crdgen.structural_problems(schema) == []
    assert version["subresources"] == {"status": {}}
    text = crdgen.render(crd)
    for forbidden in ("$ref", "$defs", "anyOf", "title:", "default: null"):
        assert forbidden not in text
    # every field of the spec carries a description from the models
    for path, sub in walk(schema["properties"]["spec"], "spec"):
        assert sub.get("description"), f"{path} has no description"


def test_structural_checker_rejects_what_the_api_server_rejects() -> None:
    bad = {
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/A"},
            "b": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "c": {"type": "number", "exclusiveMinimum": 0},
            "d": {"type": "array"},
        },
    }
    problems = " ".join(crdgen.structural_problems(bad))
    for expected in (".a: $ref", ".b: anyOf", ".c: exclusiveMinimum", ".d: array without items"):
        assert expected in problems


def test_inference_cache_validation_rules() -> None:
    crd = crdgen.inference_cache_crd()
    version = crd["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = " ".join(r["rule"] for r in spec["x-kubernetes-validations"])
    assert "priorityClass == 'Guaranteed'" in rules
    assert ".sum() <= 1.0" in rules
    tenant = spec["properties"]["tenants"]["items"]
    tenant_rules = [r["rule"] for r in tenant["x-kubernetes-validations"]]
    assert any("self.minShare <= self.maxShare" in r for r in tenant_rules)
    assert tenant["properties"]["priorityClass"]["enum"] == ["Guaranteed", "Standard", "BestEffort"]
    assert tenant["properties"]["minShare"]["minimum"] == 0
    assert tenant["properties"]["minShare"]["maximum"] == 1
    assert spec["properties"]["tenants"]["x-kubernetes-list-type"] == "map"
    sla = tenant["properties"]["sla"]
    assert sla["nullable"] is True
    assert sla["properties"]["p95LatencySeconds"]["exclusiveMinimum"] is True
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Model", "Tenants", "Ready", "SLA", "Age"} <= columns


def test_check_mode_reports_drift_with_the_fix(tmp_path: Any, capsys: Any) -> None:
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "operator").mkdir()
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 1
    assert "run `cachefleet crds`" in capsys.readouterr().err
    assert crdgen.main(["--root", str(tmp_path)]) == 0
    assert (tmp_path / "crds" / "inferencecaches.cachefleet.io.yaml").is_file()
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 0
