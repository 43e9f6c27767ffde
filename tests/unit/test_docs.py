"""The documentation site matches the code: generated reference pages, a runbook per alert."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from cachefleet_bench import pages
from cachefleet_operator import docgen

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "cachefleet" / "templates" / "prometheusrule.yaml"
RUNBOOKS = ROOT / "docs" / "operations" / "runbooks.md"
BENCHMARKS = ROOT / "docs" / "benchmarks"


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


@pytest.mark.parametrize(
    "page", sorted(str(p.relative_to(ROOT)) for p in pages.generated_pages(ROOT))
)
def test_the_benchmark_page_shows_what_its_result_file_generates(page: str) -> None:
    committed = (ROOT / page).read_text(encoding="utf-8")
    expected = pages.generated_pages(ROOT)[ROOT / page]
    assert committed == expected, (
        f"{page} is not what its result file generates: run `python -m cachefleet_bench.pages`"
    )


def test_every_benchmark_page_has_a_result_file() -> None:
    listed = {p.stem for p in BENCHMARKS.glob("*.md")} - {"index"}
    assert listed == {p.stem for p in (BENCHMARKS / "results").glob("*.json")}


def test_the_pages_check_names_the_page_whose_result_file_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(BENCHMARKS, tmp_path / "docs" / "benchmarks")
    result = tmp_path / "docs" / "benchmarks" / "results" / "l1.json"
    doc = json.loads(result.read_text(encoding="utf-8"))
    doc["tables"][0]["command"] += " --ops 1000"
    result.write_text(json.dumps(doc), encoding="utf-8")
    assert pages.main(["--root", str(tmp_path), "--check"]) == 1
    assert "l1.md" in capsys.readouterr().err
    assert pages.main(["--root", str(tmp_path)]) == 0
    assert "--ops 1000`" in (tmp_path / "docs" / "benchmarks" / "l1.md").read_text("utf-8")
    assert pages.main(["--root", str(tmp_path), "--check"]) == 0


def test_the_proxy_table_is_made_from_the_benchs_json_with_its_ratios() -> None:
    def series(name: str, rps: float, p50: float) -> dict[str, object]:
        point = {"rps": rps, "p50_us": p50, "p99_us": 2 * p50, "cpu_us_per_req": 10.0}
        return {"name": name, "title": name, "measurements": {"1": point, "64": point}}

    output = {
        "config": {"low_concurrency": 1, "high_concurrency": 64, "rounds": 3, "duration_s": 4},
        "environment": {"cpus": 2, "loadavg_1m_at_start": 0.1, "loadavg_1m_at_end": 0.2},
        "series": [
            series("floor", 200.0, 50.0),
            series("nginx", 100.0, 100.0),
            series("l1", 110.0, 80.0),
        ],
        "targets": [
            {"description": "L1 vs nginx", "value": 1.1, "unit": "x", "passed": True},
            {"description": "L2", "value": None, "passed": None},
        ],
    }
    columns, rows, notes = pages.proxy_table(output)
    assert columns[1] == "req/s c=64"
    l1 = rows[2]
    assert l1[1] == "110"
    assert l1[5] == "1.10x / 0.80x"  # vs nginx: req/s at c=64, p50 at c=1
    assert l1[6] == "0.55x / 1.60x"  # vs the floor
    assert notes[0] == "Targets: PASS L1 vs nginx (1.10x)."  # targets not measured are left out
