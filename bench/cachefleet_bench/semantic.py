"""``cachefleet bench semantic``: hit ratio and false hits of the semantic tier (L3).

Caches every ``origin`` of a pair file (``[{"origin", "similar"}, ...]``, e.g.
GPTCache's ``mock_data.json``) and queries with every ``similar``, through
the sidecar's own L3 code (:func:`semantic.probe_for`, the lexical guard,
:class:`semantic.SemanticIndex`), over a threshold sweep. A hit on the
query's own origin (same text) is true, on any other origin false;
``false_hit_share`` = false hits / all hits. Written to ``--json``::

    {"results": [{"threshold", "hit_ratio", "false_hit_share"}, ...],   # with the guard
     "no_contrast": [...],           # the guard without its contrast check (as before it)
     "no_guard": [...],              # the same embeddings, similarity alone
     "splits": {"tune": [...], "holdout": [...]},   # a seeded half / half split
     "near_miss": [...],             # generated near-misses: every hit is false
     "contrast": {"with_guard", "no_contrast", "no_guard": [{"threshold",
                  "false_hit_rate", "by_kind", "refused_by"}, ...], ...},
     "latency": {"10000": {"p50_us", "p99_us"}, ...},
     "embedding": {...}, "default_threshold": t}

Near-misses (a pair set the threshold was not tuned on) are made from the
origins by one meaning-changing edit each: a number changed (``2.10.0`` ->
``2.11.0``), a negation added or removed (``is`` -> ``is not``, ``can`` ->
``cannot``), or a named entity / identifier swapped for another one of the
corpus. Their hit ratio *is* their false-hit rate.

The contrast set (:func:`contrast_set`, seeded) pairs questions that mean the
opposite or ask about another thing: templates x opposed verbs, superlatives
and prepositions, lower-case names of one kind swapped (drugs, units,
currencies, languages, foods) or put in the other order. Each pair is asked
alone (cache one, ask the other), so its hit ratio *is* its false-hit rate;
``no_contrast`` is the same with the first stage of the guard only.

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
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cachefleet_common.keys import Scope
from cachefleet_sidecar.cache import semantic

DEFAULT_THRESHOLDS = (0.7, 0.75, 0.8, 0.82, 0.85, 0.88, 0.9, 0.92, 0.95)
DEFAULT_SIZES = (10_000, 100_000)
LATENCY_QUERIES = 300
SPLIT_SEED = 11
NO_GUARD = semantic.Guard(enabled=False)
#: The guard as it was before the contrast check (numbers, negation, entities, overlap).
NO_CONTRAST = semantic.Guard(contrast=False)
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
    from cachefleet_sidecar.cache.embeddings import EmbeddingUnavailable, LocalEmbeddings

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


# ------------------------------------------------------------------ contrast set
#: Opposed verbs (the first of each pair goes into the cache, the second asks).
CONTRAST_VERBS = str.split(
    "enable/disable activate/deactivate install/uninstall encrypt/decrypt compress/decompress "
    "upload/download import/export lock/unlock mount/unmount mute/unmute pin/unpin "
    "archive/unarchive follow/unfollow subscribe/unsubscribe connect/disconnect "
    "block/unblock start/stop pause/resume open/close show/hide accept/reject "
    "approve/deny buy/sell borrow/lend increase/decrease raise/lower enter/exit "
    "expand/collapse tighten/loosen heat/cool inflate/deflate attach/detach include/exclude "
    "add/remove push/pull charge/discharge zip/unzip freeze/unfreeze"
)
#: Objects the verbs act on (any verb with any object: the set is generated, not picked).
CONTRAST_OBJECTS = (
    "dark mode",
    "the firewall",
    "my account",
    "the backup",
    "notifications",
    "the shared folder",
    "this setting",
    "the battery",
    "the stock",
    "the printer driver",
)
CONTRAST_VERB_TEMPLATES = (
    "How do I {} {}?",
    "What is the fastest way to {} {}?",
    "Is it safe to {} {} on a work laptop?",
    "Why can't I {} {} from the settings page?",
)
#: Opposed adjectives in their superlative form, and the nouns they describe.
CONTRAST_SUPERLATIVES = str.split(
    "largest/smallest biggest/smallest highest/lowest hottest/coldest fastest/slowest "
    "oldest/newest longest/shortest heaviest/lightest deepest/shallowest cheapest/most-expensive "
    "closest/farthest earliest/latest strongest/weakest"
)
CONTRAST_NOUNS = ("planet", "ocean", "mountain", "city", "animal", "river", "country", "car")
CONTRAST_SUPERLATIVE_TEMPLATES = (
    "What is the {} {} in the world?",
    "Which {} is the {} one we know of?",
    "Name the {} {} ever recorded.",
)
#: Prepositions and adverbs whose opposite changes the question.
CONTRAST_RELATIONS = str.split("before/after above/below inside/outside up/down over/under")
CONTRAST_RELATION_TEMPLATES = (
    "Should I stretch {} running?",
    "Is it better to eat {} a workout?",
    "Do I take the pill {} meals?",
    "Why does the temperature drop {} the clouds?",
)
#: Lower-case names of one kind: two of a kind swapped in a template ask a different thing.
CONTRAST_ENTITIES = {
    "drug": "penicillin amoxicillin ibuprofen paracetamol aspirin insulin metformin warfarin",
    "unit": "fahrenheit celsius kelvin miles kilometers pounds kilograms inches centimeters",
    "currency": "euros dollars pounds yen francs rupees",
    "language": "python java rust golang javascript ruby kotlin",
    "food": "rice pasta bread potatoes quinoa oats lentils",
}
CONTRAST_ENTITY_TEMPLATES = {
    "drug": ("What is the usual adult dose of {}?", "Can I drink alcohol while taking {}?"),
    "unit": ("How do I convert {} to {}?", "Is a reading in {} higher than in {}?"),
    "currency": ("What is the price of the plan in {}?", "Can I pay the invoice in {}?"),
    "language": ("Is {} faster than {}?", "How do I read a csv file in {}?"),
    "food": ("How long should I cook {}?", "How many calories are in a cup of {}?"),
}
#: Framings that ask the same thing: ``reworded`` pairs cache one with a verb and ask
#: another with its opposite (more than one word differs: no minimal pair).
CONTRAST_FRAMINGS = (
    "How do I {} {}?",
    "How can I {} {}?",
    "What are the steps to {} {}?",
    "Is there a way to {} {}?",
)
CONTRAST_KINDS = ("verb", "reworded", "superlative", "relation", "entity", "order")
#: Pairs drawn per kind (a seeded sample of the whole product).
CONTRAST_PER_KIND = 60
CONTRAST_SEED = 23


def contrast_set(
    per_kind: int = CONTRAST_PER_KIND, seed: int = CONTRAST_SEED
) -> list[tuple[str, str, str]]:
    """(cached question, its opposite, kind): templates x opposed words, a seeded sample.

    ``verb``: a verb and its opposite on any object; ``reworded``: the same, asked
    in another framing ("How do I ..." / "What are the steps to ..."); ``superlative``:
    a superlative and its opposite on any noun; ``relation``: before / after and the like;
    ``entity``: one lower-case name for another of its kind (drugs, units,
    currencies, languages, foods); ``order``: two names of a kind in the other
    order around ``to`` / ``than``. Every answer from cache in this set is a false hit.
    """
    rng = random.Random(seed)
    pools: dict[str, list[tuple[str, str]]] = {kind: [] for kind in CONTRAST_KINDS}
    for pair in CONTRAST_VERBS:
        x, y = pair.split("/")
        for obj in CONTRAST_OBJECTS:
            for t in CONTRAST_VERB_TEMPLATES:
                pools["verb"].append((t.format(x, obj), t.format(y, obj)))
            for i, cached in enumerate(CONTRAST_FRAMINGS):
                for asked in CONTRAST_FRAMINGS[i + 1 :]:
                    pools["reworded"].append((cached.format(x, obj), asked.format(y, obj)))
    for pair in CONTRAST_SUPERLATIVES:
        x, y = (w.replace("-", " ") for w in pair.split("/"))
        for noun in CONTRAST_NOUNS:
            for t in CONTRAST_SUPERLATIVE_TEMPLATES:
                a, b = (
                    (t.format(noun, x), t.format(noun, y))
                    if t.startswith("Which")
                    else (t.format(x, noun), t.format(y, noun))
                )
                pools["superlative"].append((a, b))
    for pair in CONTRAST_RELATIONS:
        x, y = pair.split("/")
        for t in CONTRAST_RELATION_TEMPLATES:
            pools["relation"].append((t.format(x), t.format(y)))
    for kind, names in CONTRAST_ENTITIES.items():
        members = names.split()
        for t in CONTRAST_ENTITY_TEMPLATES[kind]:
            for x in members:
                for y in members:
                    if x == y:
                        continue
                    if t.count("{}") == 2:
                        pools["order"].append((t.format(x, y), t.format(y, x)))
                    else:
                        pools["entity"].append((t.format(x), t.format(y)))
    out: list[tuple[str, str, str]] = []
    for kind in CONTRAST_KINDS:
        pool = sorted(set(pools[kind]))
        out += [(a, b, kind) for a, b in rng.sample(pool, min(per_kind, len(pool)))]
    return out


def contrast_sweep(
    pairs: list[tuple[str, str, str]],
    vectors: dict[str, np.ndarray],
    thresholds: Sequence[float],
    guard: semantic.Guard,
) -> list[dict[str, Any]]:
    """Each pair alone: cache its first question, ask its second; every hit is false."""
    rows = []
    probes = [(probe(a), vectors[a], probe(b), vectors[b], kind) for a, b, kind in pairs]
    for threshold in thresholds:
        hits: dict[str, int] = dict.fromkeys(CONTRAST_KINDS, 0)
        refused: Counter[str] = Counter()
        for pa, va, pb, vb, kind in probes:
            index = semantic.SemanticIndex(lambda _t: 1 << 30, guard=guard)
            index.add(pa, va, 0)
            match = index.lookup(pb, vb, threshold)
            hits[kind] += match.result == "hit"
            if match.result == "guard":
                refused[str(match.reason)] += 1
        total = sum(hits.values())
        rows.append(
            {
                "threshold": threshold,
                "false_hit_rate": round(total / len(pairs), 4) if pairs else 0.0,
                "false_hits": total,
                "by_kind": hits,
                "refused_by": dict(sorted(refused.items())),
                "queries": len(pairs),
            }
        )
    return rows


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
        "no_contrast": sweep(origins, queries, vectors, thresholds, NO_CONTRAST),
        "no_guard": sweep(origins, queries, vectors, thresholds, NO_GUARD),
        "splits": {
            "tune": sweep(origins, tune, vectors, thresholds, guard),
            "holdout": sweep(origins, holdout, vectors, thresholds, guard),
            "holdout_no_contrast": sweep(origins, holdout, vectors, thresholds, NO_CONTRAST),
        },
        "near_miss": {
            "count": len(misses),
            "by_kind": {k: sum(1 for _, x in misses if x == k) for k in NEAR_MISS_KINDS},
            "with_guard": sweep(origins, nm, vectors, thresholds, guard),
            "no_contrast": sweep(origins, nm, vectors, thresholds, NO_CONTRAST),
            "no_guard": sweep(origins, nm, vectors, thresholds, NO_GUARD),
        },
        "embedding": {
            "texts": len(texts),
            "batch_ms_per_text": round(embed_s / len(texts) * 1e3, 2),
        },
    }


def evaluate_contrast(embed: Any, thresholds: Sequence[float]) -> dict[str, Any]:
    """The generated contrast set (:func:`contrast_set`) with and without the contrast check."""
    pairs = contrast_set()
    texts = list(dict.fromkeys(t for a, b, _ in pairs for t in (a, b)))
    matrix = embed(texts)
    vectors = {t: matrix[i] for i, t in enumerate(texts)}
    return {
        "count": len(pairs),
        "seed": CONTRAST_SEED,
        "by_kind": {k: sum(1 for *_, x in pairs if x == k) for k in CONTRAST_KINDS},
        "with_guard": contrast_sweep(pairs, vectors, thresholds, semantic.Guard()),
        "no_contrast": contrast_sweep(pairs, vectors, thresholds, NO_CONTRAST),
        "no_guard": contrast_sweep(pairs, vectors, thresholds, NO_GUARD),
        "examples": [list(p) for p in pairs[:: max(1, len(pairs) // 10)]],
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
    report["contrast"] = evaluate_contrast(embed, thresholds)
    report["latency"] = latency(sizes) if sizes else {}
    rows = zip(
        report["results"],
        report["no_contrast"],
        report["contrast"]["with_guard"],
        report["contrast"]["no_contrast"],
        strict=True,
    )
    for row, before, opposite, opposite_before in rows:
        print(
            f"threshold {row['threshold']:.2f}: hit ratio {row['hit_ratio']:.3f} "
            f"(without the contrast check {before['hit_ratio']:.3f}), "
            f"false-hit share {row['false_hit_share']:.3f} ({before['false_hit_share']:.3f}); "
            f"contrast set answered {opposite['false_hit_rate']:.3f} "
            f"({opposite_before['false_hit_rate']:.3f})"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("latency", "embedding")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
