"""``cachefleet bench semantic``: hit ratio and false hits of the semantic tier (L3).

Caches every ``origin`` of a pair file (``[{"origin", "similar"}, ...]``, e.g.
GPTCache's ``mock_data.json``) and queries with every ``similar``, through
the sidecar's own L3 code (:func:`semantic.probe_for`, the lexical guard,
:class:`semantic.SemanticIndex`), over a threshold sweep. A hit on the
query's own origin (same text) is true, on any other origin false;
``false_hit_share`` = false hits / all hits. Written to ``--json``::

    {"results": [{"threshold", "hit_ratio", "false_hit_share"}, ...],   # with the guard
     "no_guard": [...],              # the same embeddings, similarity alone
     "splits": {"tune": [...], "holdout": [...]},   # a seeded half / half split
     "near_miss": [...],             # generated near-misses: every hit is false
     "latency": {"10000": {"p50_us", "p99_us"}, ...},
     "embedding": {...}, "default_threshold": t}

Near-misses (a pair set the threshold was not tuned on) are made from the
origins by one meaning-changing edit each: a number changed (``2.10.0`` ->
``2.11.0``), a negation added or removed (``is`` -> ``is not``, ``can`` ->
``cannot``), or a named entity / identifier swapped for another one of the
corpus. Their hit ratio *is* their false-hit rate.

Lookup latency: an index of N random unit vectors in one partition (the
worst case: one tenant, one context), the p50 / p99 of single lookups.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cachefleet_sidecar import semantic
from cachefleet_sidecar.keys import Scope

DEFAULT_THRESHOLDS = (0.7, 0.75, 0.8, 0.82, 0.85, 0.88, 0.9, 0.92, 0.95)
DEFAULT_SIZES = (10_000, 100_000)
LATENCY_QUERIES = 300
SPLIT_SEED = 11
NO_GUARD = semantic.Guard(enabled=False)
NEAR_MISS_KINDS = ("number", "negation", "entity")
#: A second pair set, hand-written for cachefleet (everyday and support questions).
BUILTIN_PAIRS = Path(__file__).parent / "data" / "semantic_pairs.json"


def chat(text: str) -> dict[str, Any]:
    return {"model": "bench", "messages": [{"role": "user", "content": text}], "temperature": 0}


def probe(text: str) -> semantic.Probe:
    found = semantic.probe_for(chat(text), "chat", Scope("bench"))
    if isinstance(found, str):  # a text longer than MAX_TEXT_CHARS: bench it anyway
        found = semantic.Probe("bench", ("bench", "", (), 0), text, semantic.lexical(text))
    return found


def embedder(source: str) -> Any:
    """``texts -> unit rows`` for ``local`` (all-MiniLM-L6-v2) or ``hashed``."""
    if source == "hashed":
        return lambda texts: np.stack([semantic.hashed_ngrams(t) for t in texts])
    from cachefleet_sidecar.embeddings import EmbeddingUnavailable, LocalEmbeddings

    model = LocalEmbeddings("cpu")
    try:
        model._load()
    except EmbeddingUnavailable as exc:
        raise SystemExit(f"cachefleet bench semantic: {exc} (or use --source hashed)") from exc
    return model.encode_many


def sweep(
    origins: list[str],
    queries: list[tuple[str, str | None]],
    vectors: dict[str, np.ndarray],
    thresholds: Sequence[float],
    guard: semantic.Guard,
) -> list[dict[str, Any]]:
    """Cache ``origins``; ask each (query, own origin or None); one row per threshold."""
    index = semantic.SemanticIndex(lambda _t: 1 << 40, guard=guard)
    for text in dict.fromkeys(origins):
        index.add(probe(text), vectors[text], text)
    probes = [(probe(q), vectors[q], own) for q, own in queries]
    rows = []
    for threshold in thresholds:
        hits = false = guarded = 0
        for p, v, own in probes:
            match = index.lookup(p, v, threshold)
            if match.result == "guard":
                guarded += 1
            if match.result == "hit":
                hits += 1
                false += match.ref != own
        rows.append(
            {
                "threshold": threshold,
                "hit_ratio": round(hits / len(probes), 4),
                "false_hit_share": round(false / hits, 4) if hits else 0.0,
                "hits": hits,
                "false_hits": false,
                "guard_rejections": guarded,
                "queries": len(probes),
            }
        )
    return rows


# ------------------------------------------------------------------ near-misses
_NUM = re.compile(r"\d+")
_NEGATABLE = (
    (" is not ", " is "),
    (" are not ", " are "),
    (" cannot ", " can "),
    (" does not ", " does "),
    (" do not ", " do "),
)


def near_misses(origins: list[str], seed: int = SPLIT_SEED) -> list[tuple[str, str]]:
    """(edited text, kind of edit) for every origin that one edit changes in meaning."""
    rng = random.Random(seed)
    entities = sorted({e for t in origins for e in semantic.lexical(t).entities if e.isalpha()})
    out: list[tuple[str, str]] = []
    for text in dict.fromkeys(origins):
        numbers = list(_NUM.finditer(text))
        if numbers:
            m = rng.choice(numbers)
            out.append((text[: m.start()] + str(int(m.group()) + 1) + text[m.end() :], "number"))
        for negative, positive in _NEGATABLE:
            if negative in text:
                out.append((text.replace(negative, positive, 1), "negation"))
                break
            if positive in text:
                out.append((text.replace(positive, negative, 1), "negation"))
                break
        own = [e for e in semantic.lexical(text).entities if e.isalpha()]
        for name in own:
            found = re.search(rf"\b{re.escape(name)}\b", text, flags=re.IGNORECASE)
            if found is None:
                continue
            other = rng.choice(entities)
            if other != name:
                swapped = other.capitalize() if found.group()[0].isupper() else other
                out.append((text[: found.start()] + swapped + text[found.end() :], "entity"))
            break
    return [(t, k) for t, k in out if t not in set(origins)]


# ------------------------------------------------------------------ latency
def latency(sizes: Sequence[int], dim: int = 384, seed: int = 7) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, float]] = {}
    p = probe("what is the capital of france")
    for size in sizes:
        index = semantic.SemanticIndex(lambda _t: 1 << 40)
        vectors = rng.standard_normal((size, dim), dtype=np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        for i in range(size):  # distinct texts (the same text would replace its entry)
            index.add(semantic.Probe(p.tenant, p.partition, f"q{i}", p.lexical), vectors[i], i)
        queries = rng.standard_normal((LATENCY_QUERIES, dim), dtype=np.float32)
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        times = []
        for q in queries:
            t0 = time.perf_counter()
            index.lookup(p, q, 0.99)
            times.append(time.perf_counter() - t0)
        times.sort()
        out[str(size)] = {
            "p50_us": round(times[len(times) // 2] * 1e6, 1),
            "p99_us": round(times[int(len(times) * 0.99)] * 1e6, 1),
            "index_mib": round(sum(s.used_bytes for s in index.stats().values()) / 2**20, 1),
        }
    return out


def evaluate(
    pairs: list[tuple[str, str]], embed: Any, thresholds: Sequence[float]
) -> dict[str, Any]:
    """Every sweep of one pair set (see the module docstring)."""
    origins = [o for o, _ in pairs]
    misses = near_misses(origins)
    texts = list(dict.fromkeys([*origins, *(s for _, s in pairs), *(t for t, _ in misses)]))
    t0 = time.perf_counter()
    matrix = embed(texts)
    embed_s = time.perf_counter() - t0
    vectors = {t: matrix[i] for i, t in enumerate(texts)}
    queries = [(s, o) for o, s in pairs]
    order = list(range(len(queries)))
    random.Random(SPLIT_SEED).shuffle(order)
    half = set(order[: len(order) // 2])
    tune = [q for i, q in enumerate(queries) if i in half]
    holdout = [q for i, q in enumerate(queries) if i not in half]
    guard = semantic.Guard()
    nm = [(t, None) for t, _ in misses]
    return {
        "pairs": len(pairs),
        "results": sweep(origins, queries, vectors, thresholds, guard),
        "no_guard": sweep(origins, queries, vectors, thresholds, NO_GUARD),
        "splits": {
            "tune": sweep(origins, tune, vectors, thresholds, guard),
            "holdout": sweep(origins, holdout, vectors, thresholds, guard),
        },
        "near_miss": {
            "count": len(misses),
            "by_kind": {k: sum(1 for _, x in misses if x == k) for k in NEAR_MISS_KINDS},
            "with_guard": sweep(origins, nm, vectors, thresholds, guard),
            "no_guard": sweep(origins, nm, vectors, thresholds, NO_GUARD),
        },
        "embedding": {
            "texts": len(texts),
            "batch_ms_per_text": round(embed_s / len(texts) * 1e3, 2),
        },
    }


def read_pairs(path: Path) -> list[tuple[str, str]]:
    doc = json.loads(path.read_text())
    return [(str(p["origin"]), str(p["similar"])) for p in doc]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cachefleet bench semantic", description=__doc__)
    parser.add_argument(
        "--pairs",
        default=str(BUILTIN_PAIRS),
        help="JSON list of {origin, similar} (default: the 40 hand-written pairs shipped here)",
    )
    parser.add_argument("--json", dest="json_out", help="write the results here")
    parser.add_argument("--source", choices=("local", "hashed"), default="local")
    parser.add_argument(
        "--thresholds",
        default=",".join(str(t) for t in DEFAULT_THRESHOLDS),
        help="comma-separated similarity thresholds",
    )
    parser.add_argument(
        "--sizes", default=",".join(str(s) for s in DEFAULT_SIZES), help="index sizes (latency)"
    )
    parser.add_argument("--limit", type=int, default=0, help="use only the first N pairs")
    parser.add_argument("--quick", action="store_true", help="latency at 10k entries only")
    args = parser.parse_args(argv)
    try:
        pairs = read_pairs(Path(args.pairs))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"cachefleet bench semantic: cannot read pairs: {exc}", file=sys.stderr)
        return 2
    if args.limit:
        pairs = pairs[: args.limit]
    thresholds = [float(t) for t in args.thresholds.split(",") if t]
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.quick:
        sizes = sizes[:1]
    embed = embedder(args.source)
    report: dict[str, Any] = {
        "source": args.source,
        "default_threshold": semantic.DEFAULT_THRESHOLD,
        "guard": {
            "entity_floor": semantic.Guard().entity_floor,
            "overlap_floor": semantic.Guard().overlap_floor,
        },
        **evaluate(pairs, embed, thresholds),
    }
    if Path(args.pairs).resolve() != BUILTIN_PAIRS.resolve():
        report["second_set"] = evaluate(read_pairs(BUILTIN_PAIRS), embed, thresholds)
    report["latency"] = latency(sizes) if sizes else {}
    for row in report["results"]:
        print(
            f"threshold {row['threshold']:.2f}: hit ratio {row['hit_ratio']:.3f}, "
            f"false-hit share {row['false_hit_share']:.3f}"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("latency", "embedding")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
