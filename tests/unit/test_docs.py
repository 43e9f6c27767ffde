"""The documentation site matches the code: generated reference pages, a runbook per alert."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cachefleet_operator import docgen

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "cachefleet" / "templates" / "prometheusrule.yaml"
RUNBOOKS = ROOT / "docs" / "operations" / "runbooks.md"


@pytest.mark.parametrize("page", sorted(docgen.generated_pages()))
def test_the_committed_reference_page_is_what_the_code_generates(page: str) -> None:
    committed = (ROOT / page).read_text(encoding="utf-8")
    assert committed == docgen.generated_pages()[page], f"{page} drifted: run `cachefleet docs`"


def test_every_alert_of_the_chart_has_a_runbook_entry() -> None:
    alerts = set(re.findall(r"-\s*alert:\s*(\w+)", RULES.read_text(encoding="utf-8")))
    assert len(alerts) >= 5, "the PrometheusRule template parsed to almost no alerts"
    entries = set(re.findall(r"^## (\w+)\s*$", RUNBOOKS.read_text(encoding="utf-8"), re.M))
    assert alerts - entries == set(), "alerts without a runbook entry"
    assert entries - alerts == set(), "runbook entries for alerts the chart does not have"


def test_the_flags_page_lists_every_program_and_their_environment_names() -> None:
    page = docgen.flags_page()
    for program in ("cachefleet sidecar", "cachefleet operator", "cachefleet router"):
        assert f"## `{program}`" in page
    assert "`--redis-url` | `CACHEFLEET_REDIS_URL`" in page
    assert "### `kubectl cachefleet explain-key`" in page


def test_the_crd_page_lists_nested_fields_with_their_types() -> None:
    page = docgen.crds_page()
    assert "| `spec.capacity.l1BytesPerPod` | integer or string |" in page
    assert "`spec.tenants[].priorityClass`" in page
