"""``cachefleet bench decision``: tokenize + reduce + pick over 16 endpoints, a smoke run.

Outcomes, not speed: every request decided, follow-up turns sent to the endpoint
whose KV events say it holds their conversation; timings only as a ratio with a
generous bound (no pathological tail), never as absolute times.
"""

from __future__ import annotations

import json
from pathlib import Path

from cachefleet_bench import decision as bench
from cachefleet_bench.__main__ import BENCHMARKS

TINY = Path(__file__).resolve().parents[1] / "data" / "vllm" / "tiny"


def test_decision_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "decision.json"
    argv = [
        "--conversations",
        "8",
        "--turns",
        "4",
        "--tokenizer-dir",
        str(TINY),
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    payload = json.loads(out.read_text())
    result = payload["result"]
    assert result["endpoints"] == 16
    assert result["decisions"] == 32
    assert result["prompt_tokens_mean"] > 1000  # real token ids, long shared system prompts
    assert result["followups_to_holder"] >= 0.8
    assert result["decision_p99_us"] <= 20 * result["decision_p50_us"]
    assert payload["targets"] == {"p99<=10ms": result["decision_p99_us"] <= 10_000}


def test_the_bench_trains_its_own_tokenizer(tmp_path: Path) -> None:
    directory = bench.train_tokenizer(tmp_path / "tok")
    assert (directory / "tokenizer.json").is_file()
    assert "chat_template" in json.loads((directory / "tokenizer_config.json").read_text())


def test_decision_is_a_listed_benchmark() -> None:
    assert BENCHMARKS["decision"][0] == "cachefleet_bench.decision"
