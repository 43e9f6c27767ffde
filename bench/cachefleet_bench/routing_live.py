"""``cachefleet bench routing --live``: a trace slice replayed over real vLLM servers.

Where ``cachefleet bench routing`` simulates the pods, this mode sends a
Mooncake-format trace slice to N real vLLM servers (the tiny model of the
``vllm`` test tier, started here unless ``--urls`` names running ones) through
``cachefleet router`` in process, once per profile (``--profile``, repeatable:
``default``, ``round-robin``, ``least-loaded``, ``gie-like``), behind the
stand-in gateway (:mod:`cachefleet_e2e.gateway`, ext_proc as a GIE gateway
asks). Every figure is vLLM's own, read from each server's ``/metrics`` before
and after a profile's run: prefix-cache hit ratio
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``
deltas), requests finished per server (``vllm:request_success_total``) and
their ratio to the mean, and the TTFT histogram
(``vllm:time_to_first_token_seconds``: mean, p50 and p95 as the bucket's
upper bound). Each profile starts from empty caches (``POST
/reset_prefix_cache`` on every server: the servers need
``VLLM_SERVER_DEV_MODE=1``, as the tier's have).

The prompt of a request is text synthesised from its ``hash_ids``: each id
becomes ``--words-per-block`` words drawn by a generator seeded with the id, so
equal leading ids make equal leading text, hence equal leading tokens (each
block's text starts at a space). Only the first ``--max-blocks`` ids are used
(the tiny servers hold 1,024 blocks of 32 tokens). Requests are sent open-loop
at ``--rate`` per second in the trace's order (its timestamps are not used:
the slice is compressed to the rate), each answering ``--max-tokens`` tokens.

    cachefleet bench routing --live [--trace T] [--offset N] [--limit N]
        [--servers N | --urls U1,U2] [--profile P ...] [--rate R] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cachefleet_bench.mooncake import TraceError, load_trace, trace_path

PROFILES = ("default", "round-robin", "least-loaded", "gie-like")
DEFAULT_TRACE = "conversation"
DEFAULT_LIMIT = 120
DEFAULT_RATE = 8.0
DEFAULT_SERVERS = 3
DEFAULT_MAX_BLOCKS = 16
DEFAULT_WORDS_PER_BLOCK = 12
DEFAULT_MAX_TOKENS = 8
#: bound on one request, seconds (a generous deadline, not a measurement)
REQUEST_TIMEOUT_S = 120.0
#: bound on waiting for the router to be subscribed to every server's KV events, seconds
SUBSCRIBE_BOUND_S = 30.0
#: bound on waiting for the servers' counters to count every request, seconds
SETTLE_BOUND_S = 60.0
WORDS = [
    "cache",
    "block",
    "route",
    "prefix",
    "token",
    "server",
    "queue",
    "event",
    "model",
    "fleet",
    "answer",
    "prompt",
    "tenant",
    "budget",
    "window",
    "stream",
    "metric",
    "scrape",
    "pod",
    "replica",
    "gateway",
    "picker",
    "index",
    "chain",
]


def block_text(hash_id: int, words: int) -> str:
    """The text standing for one trace block (the same id, the same text)."""
    rng = random.Random(hash_id)
    return "".join(f" {rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(words))


def prompt_of(hash_ids: Sequence[int], *, max_blocks: int, words: int) -> str:
    return "".join(block_text(h, words) for h in hash_ids[:max_blocks])


# ------------------------------------------------------------------ vLLM's own counters


@dataclass
class Counters:
    """One server's counters at one moment (the families this bench reads)."""

    hits: float = 0.0
    queries: float = 0.0
    finished: float = 0.0
    ttft_count: float = 0.0
    ttft_sum: float = 0.0
    #: cumulative TTFT bucket counts by upper bound
    ttft_buckets: dict[float, float] = field(default_factory=dict)


def parse_counters(text: str) -> Counters:
    c = Counters()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:prefix_cache_hits_total":
                c.hits += s.value
            elif s.name == "vllm:prefix_cache_queries_total":
                c.queries += s.value
            elif s.name == "vllm:request_success_total":
                c.finished += s.value
            elif s.name == "vllm:time_to_first_token_seconds_count":
                c.ttft_count += s.value
            elif s.name == "vllm:time_to_first_token_seconds_sum":
                c.ttft_sum += s.value
            elif s.name == "vllm:time_to_first_token_seconds_bucket":
                le = float(s.labels["le"])
                c.ttft_buckets[le] = c.ttft_buckets.get(le, 0.0) + s.value
    return c


def _quantile(buckets: dict[float, float], count: float, q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` (cumulative counts)."""
    if count <= 0:
        return 0.0
    for le in sorted(buckets):
        if buckets[le] >= q * count:
            return le
    return float("inf")


@dataclass
class ProfileResult:
    """What vLLM counted while one profile routed the slice."""

    profile: str
    requests: int
    ok: int
    hit_ratio: float
    hits: float
    queries: float
    #: requests finished per server (vLLM's counter), in the servers' order
    per_server: list[float]
    max_load_ratio: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    seconds: float


def summarise(
    profile: str,
    before: Sequence[Counters],
    after: Sequence[Counters],
    *,
    requests: int,
    ok: int,
    seconds: float,
) -> ProfileResult:
    hits = sum(a.hits - b.hits for a, b in zip(after, before, strict=True))
    queries = sum(a.queries - b.queries for a, b in zip(after, before, strict=True))
    per_server = [a.finished - b.finished for a, b in zip(after, before, strict=True)]
    mean = sum(per_server) / len(per_server) if per_server else 0.0
    count = sum(a.ttft_count - b.ttft_count for a, b in zip(after, before, strict=True))
    total = sum(a.ttft_sum - b.ttft_sum for a, b in zip(after, before, strict=True))
    buckets: dict[float, float] = {}
    for a, b in zip(after, before, strict=True):
        for le, n in a.ttft_buckets.items():
            buckets[le] = buckets.get(le, 0.0) + n - b.ttft_buckets.get(le, 0.0)
    return ProfileResult(
        profile=profile,
        requests=requests,
        ok=ok,
        hit_ratio=hits / queries if queries else 0.0,
        hits=hits,
        queries=queries,
        per_server=per_server,
        max_load_ratio=max(per_server) / mean if mean else 0.0,
        ttft_mean_s=total / count if count else 0.0,
        ttft_p50_s=_quantile(buckets, count, 0.5),
        ttft_p95_s=_quantile(buckets, count, 0.95),
        seconds=seconds,
    )


async def read_counters(http: httpx.AsyncClient, urls: Sequence[str]) -> list[Counters]:
    answers = await asyncio.gather(*(http.get(f"{u}/metrics") for u in urls))
    return [parse_counters(a.text) for a in answers]


# ------------------------------------------------------------------ one profile's run


async def run_profile(
    profile: str,
    urls: Sequence[str],
    prompts: Sequence[str],
    *,
    rate: float,
    max_tokens: int,
    model: str,
) -> ProfileResult:
    """Reset the servers' caches, route ``prompts`` open-loop through a fresh router
    running ``profile``, and read what vLLM counted."""
    from cachefleet_e2e import routing_demo
    from cachefleet_e2e.gateway import Gateway
    from cachefleet_router.server import RouterConfig, RouterServer

    addresses = [u.removeprefix("http://").rstrip("/") for u in urls]
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        for u in urls:
            answer = await http.post(f"{u}/reset_prefix_cache")
            answer.raise_for_status()
        router = RouterServer(
            RouterConfig(
                grpc_listen=("127.0.0.1", 0),
                metrics_listen=None,
                endpoints=tuple(addresses),
                profile=profile,
            )
        )
        await router.start()
        gw = Gateway(picker=f"127.0.0.1:{router.grpc_port}", endpoints=addresses)
        runner, gateway_url = await routing_demo._serve_gateway(gw)
        try:
            deadline = time.monotonic() + SUBSCRIBE_BOUND_S
            while len(router.pool.ready()) < len(addresses) or (
                router.kv_events is not None and len(router.kv_events.subscribed()) < len(urls)
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the router did not see every server ready in time")
                await asyncio.sleep(0.1)
            before = await read_counters(http, urls)
            began = time.monotonic()

            async def one(i: int, prompt: str) -> bool:
                await asyncio.sleep(max(0.0, began + i / rate - time.monotonic()))
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                with contextlib.suppress(httpx.HTTPError):
                    answer = await http.post(f"{gateway_url}/v1/completions", json=body)
                    return answer.status_code == 200
                return False

            oks = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            seconds = time.monotonic() - began
            # the counters move when the engine's step ends, a moment after the answer
            deadline = time.monotonic() + SETTLE_BOUND_S
            while True:
                after = await read_counters(http, urls)
                done = sum(a.finished - b.finished for a, b in zip(after, before, strict=True))
                if done >= sum(oks) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
        finally:
            await runner.cleanup()
            await gw.close()
            await router.stop(0)
    return summarise(profile, before, after, requests=len(prompts), ok=sum(oks), seconds=seconds)


# ------------------------------------------------------------------ the report


def table(results: Sequence[ProfileResult]) -> str:
    base = next((r for r in results if r.profile == "round-robin"), None)
    lines = [
        "| profile | requests ok | vLLM prefix hit ratio | vs round-robin | requests per "
        "server | max / mean load | TTFT mean (s) | p50 (s) | p95 (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        versus = f"{r.hit_ratio / base.hit_ratio:.2f}x" if base and base.hit_ratio else "-"
        lines.append(
            f"| {r.profile} | {r.ok}/{r.requests} | {r.hit_ratio:.3f} | {versus} | "
            f"{'/'.join(f'{n:.0f}' for n in r.per_server)} | {r.max_load_ratio:.2f} | "
            f"{r.ttft_mean_s:.4f} | {r.ttft_p50_s:g} | {r.ttft_p95_s:g} |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def servers(count: int) -> Iterator[list[str]]:
    """``count`` real vLLM servers on the tiny model (the tier's harness); their URLs."""
    from cachefleet_e2e.vllm_server import VllmServer, start_all, tiny_model

    model = tiny_model()
    pool = [VllmServer(model.path, name=f"bench-live-{i}") for i in range(count)]
    try:
        start_all(pool)
        yield [s.url for s in pool]
    finally:
        for s in pool:
            s.stop()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cachefleet bench routing --live",
        description="Replay a trace slice over real vLLM servers through the router's profiles.",
    )
    p.add_argument("--live", action="store_true", help="this mode (real vLLM servers)")
    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake JSONL, or a named trace")
    p.add_argument("--offset", type=int, default=0, help="skip the trace's first N requests")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="requests replayed")
    p.add_argument("--servers", type=int, default=DEFAULT_SERVERS, help="vLLM servers to start")
    p.add_argument("--urls", help="comma-separated URLs of running vLLM servers instead")
    p.add_argument(
        "--profile",
        action="append",
        choices=PROFILES,
        help=f"repeatable (default: all of {', '.join(PROFILES)})",
    )
    p.add_argument("--rate", type=float, default=DEFAULT_RATE, help="requests per second")
    p.add_argument("--max-blocks", type=int, default=DEFAULT_MAX_BLOCKS)
    p.add_argument("--words-per-block", type=int, default=DEFAULT_WORDS_PER_BLOCK)
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--model", default="tiny", help="the served model name")
    p.add_argument("--json", type=Path, help="write the results here")
    return p


def prompts_of(args: argparse.Namespace) -> list[str]:
    trace = load_trace(trace_path(args.trace), limit=args.offset + args.limit)
    return [
        prompt_of(r.blocks, max_blocks=args.max_blocks, words=args.words_per_block)
        for r in trace[args.offset :]
    ]


def run(args: argparse.Namespace, urls: Sequence[str]) -> list[ProfileResult]:
    prompts = prompts_of(args)
    results = []
    for profile in args.profile or PROFILES:
        results.append(
            asyncio.run(
                run_profile(
                    profile,
                    urls,
                    prompts,
                    rate=args.rate,
                    max_tokens=args.max_tokens,
                    model=args.model,
                )
            )
        )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name in ("limit", "servers", "max_blocks", "words_per_block", "max_tokens"):
        if getattr(args, name) <= 0:
            print(f"cachefleet bench routing --live: --{name} must be positive", file=sys.stderr)
            return 2
    if args.rate <= 0 or args.offset < 0:
        print("cachefleet bench routing --live: --rate > 0, --offset >= 0", file=sys.stderr)
        return 2
    try:
        prompts_of(args)  # the trace is readable before any server starts
    except TraceError as exc:
        print(f"cachefleet bench routing --live: {exc}", file=sys.stderr)
        return 2
    if args.urls:
        results = run(args, [u.strip().rstrip("/") for u in args.urls.split(",") if u.strip()])
    else:
        with servers(args.servers) as urls:
            results = run(args, urls)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
