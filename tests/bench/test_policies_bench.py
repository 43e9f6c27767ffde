"""``cachefleet bench policies``: the replay is the standard one, the output is complete.

A small synthetic Mooncake-format trace (prefix-sharing requests) stands in
for the real one; hit ratios are deterministic, so exact agreement with
libCacheSim's LRU and Belady on it is a fair check of the replay.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

import pytest

from cachefleet_bench import mooncake
from cachefleet_bench import policies as bench


def write_trace(path: Path, requests: int = 400, seed: int = 5) -> list[list[int]]:
    """Conversation-like requests: a shared system prompt, then growing histories."""
    rng = random.Random(seed)
    conversations: list[list[int]] = []
    next_block = 1000
    out = []
    for _ in range(requests):
        if conversations and rng.random() < 0.6:
            conv = rng.choice(conversations)
        else:
            conv = [1, 2, 3]  # the shared prefix
            conversations.append(conv)
        grow = rng.randint(1, 4)
        conv.extend(range(next_block, next_block + grow))
        next_block += grow
        out.append(list(conv))
    with path.open("w") as f:
        for i, ids in enumerate(out):
            f.write(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "hash_ids": ids}))
            f.write("\n")
    return out


def test_prefix_hit_ratio_counts_only_the_leading_run() -> None:
    # Second request: 1 hits (leading), 9 misses, 3 hits but no longer leads.
    requests = [[1, 2, 3], [1, 9, 3]]
    miss, prefix = bench.replay_ours(requests, "lru", 10)
    assert miss == pytest.approx(4 / 6)
    assert prefix == pytest.approx(1 / 6)


def test_our_lru_replay_matches_libcachesim(tmp_path: Path) -> None:
    pytest.importorskip("libcachesim")
    requests = write_trace(tmp_path / "t.jsonl")
    blocks = bench.footprint(requests)
    for fraction in (0.05, 0.2):
        size = bench.cache_size(fraction, blocks)
        ours = bench.replay_ours(requests, "lru", size)
        theirs = bench.replay_libcachesim(requests, "LRU", size)
        assert ours == theirs
        opt = bench.replay_libcachesim(requests, "Belady", size)
        assert opt[0] <= ours[0]
        for name in ("lirs", "sits"):
            assert bench.replay_ours(requests, name, size)[0] >= opt[0]


def test_main_writes_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    trace = tmp_path / "t.jsonl"
    write_trace(trace, requests=150)
    out = tmp_path / "r.json"
    png = tmp_path / "r.png"
    code = bench.main(
        [
            "--trace",
            str(trace),
            "--sizes",
            "0.05,0.2",
            "--policies",
            "lru,lirs,sits",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["trace"] == str(trace)
    rows = {(r["policy"], r["size_fraction"]) for r in doc["results"]}
    assert rows == {(p, s) for p in ("lru", "lirs", "sits") for s in (0.05, 0.2)}
    for r in doc["results"]:
        assert 0.0 <= r["prefix_hit_ratio"] <= 1.0 - r["miss_ratio"] + 1e-9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "sits" in text
    assert "best other online policy" in text


@pytest.mark.parametrize(
    ("content", "reason"),
    [("not json\n", "not JSON"), ('{"hash_ids": "x"}\n', "hash_ids"), ("", "no requests")],
)
def test_bad_traces_are_refused_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, reason: str
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(content)
    assert bench.main(["--trace", str(trace), "--policies", "lru"]) == 2
    assert reason in capsys.readouterr().err


def test_unknown_policy_and_bad_sizes_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, requests=20)
    assert bench.main(["--trace", str(trace), "--policies", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--trace", str(trace), "--sizes", "0,2"])


def write_workload(path: Path, n: int = 600, seed: int = 9) -> float:
    """Two tenants, Zipf-ish keys, sizes and costs varying; the total upstream seconds."""
    rng = random.Random(seed)
    total = 0.0
    with path.open("w") as f:
        for i in range(n):
            tenant = "a" if i % 3 else "b"
            rank = int(rng.paretovariate(1.2)) % 200
            key = f"{tenant}-{rank}"
            cost = 0.1 + (rank % 10) / 10
            total += cost
            size = 500 + (rank % 7) * 300
            f.write(
                json.dumps(
                    {"ts": i, "tenant": tenant, "key": key, "bytes": size, "upstream_s": cost}
                )
            )
            f.write("\n")
    return total


def test_workload_replay_accounts_every_upstream_second(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    total = write_workload(path)
    out = tmp_path / "w.json"
    assert bench.main(["--workload", str(path), "--l1-mib", "0.02,0.1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["policy"], r["l1_bytes"]) for r in rows} == {
        (p, int(m * 2**20)) for p in ("lru", "lirs", "sits", "sits p=1") for m in (0.02, 0.1)
    }
    for r in rows:
        assert r["upstream_s_paid"] + r["upstream_s_saved"] == pytest.approx(total)
        assert 0.0 < r["hit_ratio"] < 1.0
    paid = {(r["policy"], r["l1_bytes"]): r["upstream_s_paid"] for r in rows}
    # A bigger L1 never pays more, for any policy.
    for p in ("lru", "lirs", "sits"):
        assert paid[(p, int(0.1 * 2**20))] <= paid[(p, int(0.02 * 2**20))]


def test_bad_workloads_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"tenant": "a", "key": "k"}\n')
    assert bench.main(["--workload", str(path)]) == 2
    assert "upstream_s" in capsys.readouterr().err
    write_workload(path, n=10)
    assert bench.main(["--workload", str(path), "--policies", "lcs-ARC"]) == 2
    assert "cachefleet's policies only" in capsys.readouterr().err


def test_a_missing_trace_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "--trace" in capsys.readouterr().err


def test_synthetic_traces_are_deterministic_and_shaped_as_described() -> None:
    a = bench.synthetic_traces(n=3000, seed=4)
    assert a == bench.synthetic_traces(n=3000, seed=4)
    assert set(a) == {"zipf-0.8", "zipf-1.0", "zipf+scans", "shifting", "loop"}
    flat = {name: [r[0] for r in reqs] for name, reqs in a.items()}
    assert all(len(reqs) == 3000 for name, reqs in flat.items() if name != "zipf+scans")
    # scans: 20 never-seen keys every 50 accesses
    scans = [k for k in flat["zipf+scans"] if k >= 1_000_000]
    assert len(scans) == len(set(scans)) == 20 * 60
    # the loop visits keys in rounds, each key once per round
    assert sorted(flat["loop"][:3000]) == sorted(set(flat["loop"][:3000]))
    # a Zipf head: the most popular key is far above the mean
    counts: dict[int, int] = {}
    for k in flat["zipf-1.0"]:
        counts[k] = counts.get(k, 0) + 1
    assert max(counts.values()) > 20 * (3000 / len(counts))


def test_a_gzip_trace_reads_as_the_plain_one(tmp_path: Path) -> None:
    plain = tmp_path / "t.jsonl"
    requests = write_trace(plain, requests=50)
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert bench.load_trace(packed) == bench.load_trace(plain) == requests
    assert mooncake.load_trace(packed) == mooncake.load_trace(plain)


def test_a_broken_gzip_trace_is_refused_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl.gz"
    trace.write_text('{"hash_ids": [1]}\n')  # named .gz, not compressed
    assert bench.main(["--trace", str(trace), "--policies", "lru"]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_the_shipped_conversation_trace_is_the_documented_one() -> None:
    """``--trace conversation``: Mooncake's trace as data/README.md describes it."""
    path = mooncake.trace_path("conversation")
    assert path == mooncake.CONVERSATION_TRACE
    raw = gzip.decompress(path.read_bytes())
    readme = (path.parent / "README.md").read_text()
    assert hashlib.sha256(raw).hexdigest() in readme
    requests = bench.load_trace(path)
    assert (len(requests), sum(map(len, requests)), bench.footprint(requests)) == (
        12_031,
        288_500,
        182_790,
    )
    assert mooncake.trace_path("elsewhere.jsonl") == Path("elsewhere.jsonl")
