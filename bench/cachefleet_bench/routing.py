"""Routing benchmark: a Mooncake trace replayed over simulated model-server pods.

``cachefleet bench routing`` replays a Mooncake-format trace (one JSON object a
line: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of
512-token blocks, equal prefixes sharing leading ids) over N simulated pods,
each routed request chosen by one policy. Deterministic: a discrete-event
simulation in simulated time, no wall clock, no randomness but a seeded one.

The pod model (the issue's): per pod an LRU of B blocks (a prompt's blocks
are added when its prefill starts, touched last-to-first so eviction eats
prefixes from the tail) and a serial FIFO prefill queue running at R uncached
tokens/s. A request's time to first token is its wait in the queue plus
``(input_length - 512 * matched leading blocks) / R``, the match taken when its
prefill starts. Arrival times are the trace's divided by ``--speed``.

Every ``--scrape-interval`` simulated seconds each pod exports vLLM-like
metrics (requests waiting / running, KV usage and capacity, prefix-cache
queries and hits in tokens, prompt tokens, prefill seconds), which the
policies that read metrics see, as a router would, up to one period late.

Policies:

* ``round-robin``, ``least-loaded`` (Envoy's least-request balancer with its
  defaults: of two pods drawn at random, the one with fewer requests routed and
  not done) and ``gie-like`` (the Gateway API Inference Extension's default
  profile: queue x2, KV-cache utilisation x2, prefix x3, its own LRU index of
  what it routed, ties at random, seeded; it reads the metrics every
  ``--gie-refresh``, GIE's 50 ms, the others every ``--scrape-interval``): the
  router's own profiles of those names (:mod:`cachefleet_router.profiles`), fed
  the simulated metrics and clock; ``session-hash`` (the hash of the request's
  conversation, :func:`cachefleet_bench.mooncake.conversation_ids`);
* ``cachefleet-session``: the ``default`` profile, every request carrying its
  conversation as its session (the router's ``--session-header``);
* ``cachefleet``: the router's ``default`` profile
  (:class:`cachefleet_router.scoring.ScoringPicker`), the real scoring code;
* ``precise``: the least expected TTFT knowing every pod's real cache (and the
  blocks of its queued requests) and real queue: an oracle of the same model.

Figures per policy: ``kv_hit`` (prompt tokens served from a pod's prefix
cache / all prompt tokens), TTFT mean and p50 / p95 / p99 (seconds), and
``max_load_ratio`` (the most prefill seconds any pod did / the mean over
pods). A second part times :meth:`ScoringPicker.pick` with 64 endpoints and a
warmed index (p50 / p99, microseconds) and measures the index's memory per
block (tracemalloc): the issue's decision-latency target.

    cachefleet bench routing [--trace T.jsonl] [--json OUT] [--pods N]
        [--kv-blocks B] [--prefill-rate R] [--speed X] [--scrape-interval S] [--gie-refresh S]
        [--policies a,b] [--limit N] [--epsilon E] [--replicas K] [--decision-picks N]

``--live`` replays a trace slice over real vLLM servers instead
(:mod:`cachefleet_bench.routing_live`).

``--replicas K`` runs every policy as K independent pickers (router replicas
that share nothing: each its own index, counters, in-flight view), the
requests dealt to them in turn.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import time
import tracemalloc
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachefleet_bench.admission_replay import admission_rows, admission_table, admission_targets
from cachefleet_bench.mooncake import (
    BLOCK_TOKENS,
    DEFAULT_TRACE,
    TraceError,
    TraceRequest,
    conversation_ids,
    load_trace,
    trace_path,
)
from cachefleet_router.endpoints import Decision, Endpoint, EndpointMetrics, Picker, RouteRequest
from cachefleet_router.kvevents import BlockRemoved, BlockStored, EventBatch, KvEvent
from cachefleet_router.kvindex import KvIndex
from cachefleet_router.prefix import PrefixIndex
from cachefleet_router.profiles import build as build_profile
from cachefleet_router.scoring import ScoringConfig, ScoringPicker

#: Defaults (docs/routing.md says how they were chosen): 8 pods of 2,000 blocks
#: (1 M tokens of KV each), 20,000 uncached tokens/s of prefill each, the trace
#: played 2x faster.
DEFAULT_PODS = 8
DEFAULT_KV_BLOCKS = 2000
DEFAULT_PREFILL_RATE = 20_000.0
DEFAULT_SPEED = 2.0
DEFAULT_SCRAPE_INTERVAL = 0.5
#: the ``gie-like`` row reads the metrics as often as GIE's picker does by default: its
#: ``--refresh-metrics-interval`` (50 ms, ``DefaultRefreshMetricsInterval`` in
#: ``pkg/epp/server/runserver.go``); the other rows at ``--scrape-interval``, the router's default
DEFAULT_GIE_REFRESH = 0.05
DEFAULT_DECISION_PICKS = 5000
DECISION_ENDPOINTS = 64
POLICIES = (
    "round-robin",
    "least-loaded",
    "session-hash",
    "gie-like",
    "cachefleet",
    "cachefleet-kv",
    "cachefleet-session",
    "precise",
)
#: policies whose requests carry the trace's conversation as their session
SESSION_POLICIES = frozenset({"session-hash", "cachefleet-session"})
#: the issue's targets: cachefleet against these rows
TARGET_TTFT_VS_GIE = 0.95
TARGET_TTFT_VS_RR = 0.6
TARGET_KV_HIT_GAP = 0.02
TARGET_LOAD_GAP = 0.25
TARGET_DECISION_P99_US = 1000.0


@dataclass(frozen=True, slots=True)
class Result:
    """One policy's row of the JSON."""

    policy: str
    kv_hit: float
    ttft_mean: float
    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    max_load_ratio: float


# -- the simulated pods -------------------------------------------------------------------


@dataclass(slots=True)
class _Job:
    request: TraceRequest
    decision: Decision
    route: RouteRequest
    #: uncached tokens as estimated when queued (precise's view of the backlog)
    estimate: float = 0.0
    #: its prefill's duration and prefix-cache hit tokens, once started
    seconds: float = 0.0
    hit: float = 0.0


@dataclass(slots=True)
class Pod:
    """One simulated model server: an LRU of KV blocks and a serial prefill queue."""

    capacity: int
    rate: float
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    queue: deque[_Job] = field(default_factory=deque)
    running: _Job | None = None
    free_at: float = 0.0
    #: blocks of queued (not started) jobs, counted
    pending: Counter[int] = field(default_factory=Counter)
    backlog_tokens: float = 0.0
    prompt_tokens_total: float = 0.0
    prefix_queries_total: float = 0.0
    prefix_hits_total: float = 0.0
    prefill_seconds_total: float = 0.0
    #: told the blocks each insert stored and evicted, as a server's KV events say it
    publish: Callable[[Sequence[int], list[int], list[int]], None] | None = None

    def matched(self, blocks: Sequence[int]) -> int:
        n = 0
        for block in blocks:
            if block not in self.cache:
                break
            n += 1
        return n

    def matched_future(self, blocks: Sequence[int]) -> int:
        """Leading blocks held now or by a queued request (they will be, when it is our turn)."""
        n = 0
        for block in blocks:
            if block not in self.cache and not self.pending[block]:
                break
            n += 1
        return n

    def insert(self, blocks: Sequence[int]) -> None:
        if self.publish is not None:
            self._insert_published(blocks, self.publish)
            return
        for block in reversed(blocks):
            if block in self.cache:
                self.cache.move_to_end(block)
            else:
                self.cache[block] = None
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)

    def _insert_published(
        self, blocks: Sequence[int], publish: Callable[[Sequence[int], list[int], list[int]], None]
    ) -> None:
        """:meth:`insert`, telling ``publish`` what was stored and what was evicted."""
        stored: list[int] = []
        for block in reversed(blocks):
            if block in self.cache:
                self.cache.move_to_end(block)
            else:
                self.cache[block] = None
                stored.append(block)
        evicted: list[int] = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        publish(blocks, stored, evicted)

    def metrics(self) -> EndpointMetrics:
        return EndpointMetrics(
            waiting=float(len(self.queue)),
            running=1.0 if self.running is not None else 0.0,
            kv_usage=len(self.cache) / self.capacity,
            prefix_queries_total=self.prefix_queries_total,
            prefix_hits_total=self.prefix_hits_total,
            prompt_tokens_total=self.prompt_tokens_total,
            prefill_seconds_total=self.prefill_seconds_total,
            kv_capacity_tokens=self.capacity * BLOCK_TOKENS,
            server="vllm",
        )


class _Clock:
    """The simulated clock the pickers read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- the baseline policies ----------------------------------------------------------------


class _Baseline:
    """A baseline picker: the pods' addresses in order, the simulation's view when allowed."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.slot = {address: i for i, address in enumerate(addresses)}

    def done(self, decision: Decision, request: RouteRequest, *, ok: bool) -> None:
        return None


class SessionHash(_Baseline):
    """The conversation's hash picks the pod (its ``session``: the trace's conversation id,
    :func:`cachefleet_bench.mooncake.conversation_ids`; else the first block)."""

    def pick(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Decision | None:
        if not endpoints:
            return None
        first = request.blocks[0] if request.blocks else 0
        if request.session is not None:
            first = int(request.session)
        mixed = (first * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        return Decision(endpoints[(mixed >> 17) % len(endpoints)].address)


class Precise(_Baseline):
    """The least expected TTFT knowing every pod's real cache and real queue (an oracle)."""

    def __init__(self, addresses: Sequence[str], pods: dict[str, Pod], clock: _Clock) -> None:
        super().__init__(addresses)
        self._pods = pods
        self._clock = clock

    def pick(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Decision | None:
        if not endpoints:
            return None
        now = self._clock.now
        best: tuple[float, int, str] | None = None
        for e in endpoints:
            pod = self._pods[e.address]
            wait = max(0.0, pod.free_at - now) + pod.backlog_tokens / pod.rate
            hit = min(request.tokens, BLOCK_TOKENS * pod.matched_future(request.blocks))
            ttft = wait + (request.tokens - hit) / pod.rate
            key = (ttft, self.slot[e.address], e.address)
            if best is None or key < best:
                best = key
        assert best is not None
        return Decision(best[2])


class BlockScaled:
    """The precise index as the simulation sees it: one token id per 512-token block.

    The simulated pods publish real KV events (``BlockStored`` / ``BlockRemoved``,
    one sequence per pod) into a :class:`~cachefleet_router.kvindex.KvIndex`, a
    block's "token ids" being its trace hash id (block size 1); this turns the
    matched blocks back into tokens.
    """

    def __init__(self, index: KvIndex, block_tokens: int = BLOCK_TOKENS) -> None:
        self.index = index
        self.block_tokens = block_tokens

    def matched(self, address: str, token_ids: Sequence[int]) -> tuple[int, int] | None:
        found = self.index.matched(address, token_ids)
        return None if found is None else (found[0], found[0] * self.block_tokens)


def kv_events(pods: dict[str, Pod], index: KvIndex) -> None:
    """Make every simulated pod publish its cache's changes into ``index``, as vLLM does."""
    for address, pod in pods.items():
        seq = [0]

        def publish(
            blocks: Sequence[int],
            stored: list[int],
            evicted: list[int],
            address: str = address,
            seq: list[int] = seq,
        ) -> None:
            events: list[KvEvent] = []
            if stored:
                new = set(stored)
                run: list[int] = []
                parent: int | None = None
                for i, block in enumerate(blocks):
                    if block in new:
                        if not run:
                            parent = blocks[i - 1] if i > 0 else None
                        run.append(block)
                    elif run:
                        events.append(BlockStored(tuple(run), parent, tuple(run), 1))
                        run = []
                if run:
                    events.append(BlockStored(tuple(run), parent, tuple(run), 1))
            if evicted:
                events.append(BlockRemoved(tuple(evicted)))
            if events:
                index.apply(address, seq[0], EventBatch(0.0, tuple(events)))
                seq[0] += 1

        pod.publish = publish


class Replicas:
    """Several independent pickers, as several router replicas: requests dealt in turn.

    They share nothing; each learns from what it routes and from the metrics.
    """

    def __init__(self, pickers: Sequence[Picker]) -> None:
        self._pickers = list(pickers)
        self._next = 0
        self._owner: dict[int, tuple[Decision, Picker]] = {}

    def pick(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Decision | None:
        picker = self._pickers[self._next % len(self._pickers)]
        self._next += 1
        decision = picker.pick(request, endpoints)
        if decision is not None:
            self._owner[id(decision)] = (decision, picker)
        return decision

    def done(self, decision: Decision, request: RouteRequest, *, ok: bool) -> None:
        owner = self._owner.pop(id(decision), None)
        if owner is not None:
            owner[1].done(decision, request, ok=ok)


# -- the replay ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Outcome:
    ttfts: list[float] = field(default_factory=list)
    hit_tokens: float = 0.0
    tokens: float = 0.0


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def make_policy(
    name: str,
    addresses: Sequence[str],
    pods: dict[str, Pod],
    clock: _Clock,
    kv_blocks: int,
    config: ScoringConfig,
    replicas: int = 1,
) -> Picker:
    """The picker of policy ``name`` over the simulated pods, as ``replicas`` replicas."""
    if name == "cachefleet-kv":
        index = KvIndex(max_blocks=kv_blocks)
        kv_events(pods, index)  # every replica sees every pod's events
        precise = BlockScaled(index)
        pickers = [
            build_profile("default", config, clock=clock, precise=precise) for _ in range(replicas)
        ]
        return pickers[0] if replicas == 1 else Replicas(pickers)
    if replicas > 1:
        return Replicas(
            [make_policy(name, addresses, pods, clock, kv_blocks, config) for _ in range(replicas)]
        )
    if name in ("round-robin", "least-loaded", "gie-like"):
        return build_profile(name, config, clock=clock)
    if name == "session-hash":
        return SessionHash(addresses)
    if name in ("cachefleet", "cachefleet-session"):  # -session: requests carry a session
        return build_profile("default", config, clock=clock)
    if name == "precise":
        return Precise(addresses, pods, clock)
    raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")


class _Replay:
    """One replay in progress: the pods, the picker, and the events in simulated time.

    Events: (time, order, kind, address); kinds: 0 a prefill done, 1 a scrape of
    every pod. An arrival first runs the events up to its time (:meth:`advance`).
    """

    def __init__(
        self, picker: Picker, sim: dict[str, Pod], clock: _Clock, scrape_interval: float
    ) -> None:
        self.picker = picker
        self.sim = sim
        self.clock = clock
        self.scrape_interval = scrape_interval
        self.endpoints = [Endpoint(address=a, name=a.partition(":")[0]) for a in sim]
        self.outcome = _Outcome()
        self.busy = dict.fromkeys(sim, 0.0)
        self.events: list[tuple[float, int, int, str]] = []
        self.order = 0
        self.push(scrape_interval, 1, "")

    def push(self, when: float, kind: int, address: str) -> None:
        self.order += 1
        heapq.heappush(self.events, (when, self.order, kind, address))

    def start(self, address: str, job: _Job, now: float) -> None:
        """The job's prefill starts: its prefix hit is taken now, its TTFT is known."""
        pod = self.sim[address]
        req = job.request
        matched = pod.matched(req.blocks)
        hit = min(req.input_length, BLOCK_TOKENS * matched)
        seconds = (req.input_length - hit) / pod.rate
        pod.insert(req.blocks)
        job.seconds = seconds
        pod.running = job
        pod.free_at = now + seconds
        job.hit = hit
        self.outcome.hit_tokens += hit
        self.outcome.tokens += req.input_length
        self.outcome.ttfts.append(pod.free_at - req.arrival)
        self.busy[address] += seconds
        self.push(pod.free_at, 0, address)

    def finish(self, address: str, now: float) -> None:
        """The pod's prefill is done: its counters move, the picker is told, the next starts."""
        pod = self.sim[address]
        job = pod.running
        assert job is not None
        pod.running = None
        pod.prompt_tokens_total += job.request.input_length
        pod.prefix_queries_total += job.request.input_length
        pod.prefix_hits_total += job.hit
        pod.prefill_seconds_total += job.seconds
        self.picker.done(job.decision, job.route, ok=True)
        if pod.queue:
            nxt = pod.queue.popleft()
            pod.backlog_tokens -= nxt.estimate
            for block in nxt.request.blocks:
                pod.pending[block] -= 1
            self.start(address, nxt, now)

    def scrape(self, now: float) -> None:
        for endpoint in self.endpoints:
            endpoint.metrics = self.sim[endpoint.address].metrics()
            endpoint.scraped_at = now
        self.push(now + self.scrape_interval, 1, "")

    def handle(self, when: float, kind: int, address: str) -> None:
        self.clock.now = when
        if kind == 0:
            self.finish(address, when)
        else:
            self.scrape(when)

    def advance(self, t: float) -> None:
        """Every event up to ``t``, in time order."""
        while self.events and self.events[0][0] <= t:
            when, _, kind, address = heapq.heappop(self.events)
            self.handle(when, kind, address)

    def arrive(self, req: TraceRequest, session: int | None, policy: str) -> None:
        """A request arrives: the picker routes it; it starts or queues on that pod."""
        self.advance(req.arrival)
        self.clock.now = req.arrival
        # token ids: one per block (its hash id), what the pods' KV events carry here
        route = RouteRequest(
            blocks=req.blocks,
            tokens=req.input_length,
            token_ids=req.blocks,
            session=None if session is None else str(session),
        )
        decision = self.picker.pick(route, self.endpoints)
        if decision is None:
            raise RuntimeError(f"policy {policy} chose no endpoint")
        address = decision.address
        pod = self.sim[address]
        job = _Job(req, decision, route)
        if pod.running is None:
            self.start(address, job, req.arrival)
        else:
            hit = min(req.input_length, BLOCK_TOKENS * pod.matched_future(req.blocks))
            job.estimate = req.input_length - hit
            pod.backlog_tokens += job.estimate
            for block in req.blocks:
                pod.pending[block] += 1
            pod.queue.append(job)

    def idle(self) -> bool:
        return all(p.running is None for p in self.sim.values())

    def drain(self, last_arrival: float) -> None:
        """Events until every pod is idle after the last arrival (scrapes alone end it)."""
        while self.events:
            when, _, kind, address = heapq.heappop(self.events)
            if kind == 1 and when > last_arrival and self.idle():
                break
            self.handle(when, kind, address)

    def result(self, policy: str) -> Result:
        outcome = self.outcome
        ttfts = sorted(outcome.ttfts)
        loads = list(self.busy.values())
        mean_load = statistics.fmean(loads) if loads else 0.0
        return Result(
            policy=policy,
            kv_hit=outcome.hit_tokens / outcome.tokens if outcome.tokens else 0.0,
            ttft_mean=statistics.fmean(ttfts) if ttfts else 0.0,
            ttft_p50=_percentile(ttfts, 50),
            ttft_p95=_percentile(ttfts, 95),
            ttft_p99=_percentile(ttfts, 99),
            max_load_ratio=max(loads) / mean_load if mean_load > 0 else 1.0,
        )


def replay(
    trace: Sequence[TraceRequest],
    policy: str,
    *,
    pods: int = DEFAULT_PODS,
    kv_blocks: int = DEFAULT_KV_BLOCKS,
    prefill_rate: float = DEFAULT_PREFILL_RATE,
    scrape_interval: float = DEFAULT_SCRAPE_INTERVAL,
    config: ScoringConfig | None = None,
    replicas: int = 1,
) -> Result:
    """Replay ``trace`` over ``pods`` simulated pods routed by ``policy``; one result row."""
    clock = _Clock()
    addresses = [f"pod-{i}:8000" for i in range(pods)]
    sim = {a: Pod(kv_blocks, prefill_rate) for a in addresses}
    picker = make_policy(
        policy, addresses, sim, clock, kv_blocks, config or ScoringConfig(), replicas
    )
    run = _Replay(picker, sim, clock, scrape_interval)
    # the trace's conversations as sessions, for the policies that route by them
    sessions: list[int | None] = [None] * len(trace)
    if policy in SESSION_POLICIES:
        sessions = conversation_ids([r.blocks for r in trace])
    for req, session in zip(trace, sessions, strict=True):
        run.arrive(req, session, policy)
    run.drain(trace[-1].arrival if trace else 0.0)
    return run.result(policy)


# -- the decision-latency part --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecisionBench:
    """How long :meth:`ScoringPicker.pick` takes, and what the index costs.

    Wall time includes the moments the OS gave the CPU to another process (on a
    shared machine, whole 4 ms ticks); the thread's CPU time does not: it is what
    the code costs.
    """

    endpoints: int
    picks: int
    pick_p50_us: float
    pick_p99_us: float
    pick_cpu_p50_us: float
    pick_cpu_p99_us: float
    index_blocks: int
    index_bytes_per_block: float


def decision_bench(
    trace: Sequence[TraceRequest],
    *,
    picks: int = DEFAULT_DECISION_PICKS,
    endpoints: int = DECISION_ENDPOINTS,
    kv_blocks: int = DEFAULT_KV_BLOCKS,
    config: ScoringConfig | None = None,
) -> DecisionBench:
    """Time ``picks`` decisions among ``endpoints`` after the whole trace warmed the indexes."""
    clock = _Clock()
    picker = ScoringPicker(config or ScoringConfig(), clock=clock)
    fleet = [
        Endpoint(
            address=f"pod-{i}:8000",
            metrics=EndpointMetrics(kv_capacity_tokens=kv_blocks * BLOCK_TOKENS, server="vllm"),
            scraped_at=1.0,
        )
        for i in range(endpoints)
    ]
    routes = [RouteRequest(blocks=r.blocks, tokens=r.input_length) for r in trace]
    clock.now = 1.0
    for route in routes:  # warm: every endpoint's index fills up
        decision = picker.pick(route, fleet)
        assert decision is not None
        picker.done(decision, route, ok=True)
    wall: list[int] = []
    cpu: list[int] = []
    inflight: deque[tuple[Decision, RouteRequest]] = deque()
    for i in range(picks):
        route = routes[i % len(routes)]
        clock.now += 0.001
        began, began_cpu = time.perf_counter_ns(), time.thread_time_ns()
        decision = picker.pick(route, fleet)
        cpu.append(time.thread_time_ns() - began_cpu)
        wall.append(time.perf_counter_ns() - began)
        assert decision is not None
        inflight.append((decision, route))
        if len(inflight) > 4 * endpoints:  # a steady number in flight
            old, old_route = inflight.popleft()
            picker.done(old, old_route, ok=True)
    wall.sort()
    cpu.sort()
    return DecisionBench(
        endpoints=endpoints,
        picks=picks,
        pick_p50_us=_percentile(wall, 50) / 1000.0,
        pick_p99_us=_percentile(wall, 99) / 1000.0,
        pick_cpu_p50_us=_percentile(cpu, 50) / 1000.0,
        pick_cpu_p99_us=_percentile(cpu, 99) / 1000.0,
        index_blocks=100_000,
        index_bytes_per_block=index_bytes_per_block(100_000),
    )


def index_bytes_per_block(blocks: int) -> float:
    """Bytes one block costs in a full :class:`PrefixIndex` (tracemalloc, 64-bit hashes)."""
    rng = random.Random(1)
    hashes = [rng.getrandbits(63) for _ in range(blocks)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex(blocks)
        for start in range(0, blocks, 64):
            index.insert(hashes[start : start + 64])
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # the hashes themselves are ints the request already holds; the index adds its table
    return (after - before) / blocks + sys.getsizeof(hashes[0])


# -- the command ----------------------------------------------------------------------------


def _ratio(value: float, base: float) -> str:
    return f"{value / base:5.2f}" if base > 0 else "   - "


def table(results: Sequence[Result]) -> str:
    """The results as text, with TTFT ratios against ``gie-like`` and ``round-robin``."""
    by = {r.policy: r for r in results}
    gie, rr = by.get("gie-like"), by.get("round-robin")
    lines = [
        f"{'policy':<18} {'kv_hit':>6} {'mean s':>8} {'p50 s':>8} {'p95 s':>8} {'p99 s':>8}"
        f" {'load':>5}  {'mean/gie':>8} {'p95/gie':>7} {'mean/rr':>7} {'p95/rr':>6}"
    ]
    for r in results:
        lines.append(
            f"{r.policy:<18} {r.kv_hit:6.3f} {r.ttft_mean:8.3f} {r.ttft_p50:8.3f}"
            f" {r.ttft_p95:8.3f} {r.ttft_p99:8.3f} {r.max_load_ratio:5.2f}"
            f"  {_ratio(r.ttft_mean, gie.ttft_mean if gie else 0):>8}"
            f" {_ratio(r.ttft_p95, gie.ttft_p95 if gie else 0):>7}"
            f" {_ratio(r.ttft_mean, rr.ttft_mean if rr else 0):>7}"
            f" {_ratio(r.ttft_p95, rr.ttft_p95 if rr else 0):>6}"
        )
    return "\n".join(lines)


def targets(results: Sequence[Result], decision: DecisionBench | None) -> dict[str, bool]:
    """The issue's routing targets, met or not, for the rows present."""
    by = {r.policy: r for r in results}
    ours = by.get("cachefleet")
    out: dict[str, bool] = {}
    if ours is None:
        return out
    if (gie := by.get("gie-like")) is not None:
        out["ttft_mean<=0.95x_gie"] = ours.ttft_mean <= TARGET_TTFT_VS_GIE * gie.ttft_mean
        out["ttft_p95<=0.95x_gie"] = ours.ttft_p95 <= TARGET_TTFT_VS_GIE * gie.ttft_p95
    if (rr := by.get("round-robin")) is not None:
        out["ttft_mean<=0.6x_rr"] = ours.ttft_mean <= TARGET_TTFT_VS_RR * rr.ttft_mean
        out["ttft_p95<=0.6x_rr"] = ours.ttft_p95 <= TARGET_TTFT_VS_RR * rr.ttft_p95
    if (precise := by.get("precise")) is not None:
        out["kv_hit_within_0.02_of_precise"] = ours.kv_hit >= precise.kv_hit - TARGET_KV_HIT_GAP
    if (least := by.get("least-loaded")) is not None:
        out["load<=least_loaded+0.25"] = (
            ours.max_load_ratio <= least.max_load_ratio + TARGET_LOAD_GAP
        )
    if decision is not None:
        out["decision_p99<=1ms"] = decision.pick_p99_us <= TARGET_DECISION_P99_US
        out["decision_cpu_p99<=1ms"] = decision.pick_cpu_p99_us <= TARGET_DECISION_P99_US
    return out


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {kind.__name__}: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, not {text}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cachefleet bench routing",
        description="Replay a Mooncake trace over simulated pods through each routing policy.",
    )
    p.add_argument(
        "--trace",
        type=trace_path,
        default=DEFAULT_TRACE,
        help="Mooncake-format JSONL, plain or .gz, or a name: synthetic, conversation",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--pods", type=_positive(int), default=DEFAULT_PODS)
    p.add_argument(
        "--kv-blocks", type=_positive(int), default=DEFAULT_KV_BLOCKS, help="per pod, 512 tokens"
    )
    p.add_argument(
        "--prefill-rate",
        type=_positive(float),
        default=DEFAULT_PREFILL_RATE,
        help="uncached tokens/s per pod",
    )
    p.add_argument("--speed", type=_positive(float), default=DEFAULT_SPEED, help="time compression")
    p.add_argument(
        "--scrape-interval",
        type=_positive(float),
        default=DEFAULT_SCRAPE_INTERVAL,
        help="simulated seconds between metrics scrapes",
    )
    p.add_argument(
        "--gie-refresh",
        type=_positive(float),
        default=DEFAULT_GIE_REFRESH,
        help="simulated seconds between the gie-like row's metrics reads (GIE's default)",
    )
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    p.add_argument("--limit", type=_positive(int), help="replay only the first N requests")
    p.add_argument(
        "--replicas",
        type=_positive(int),
        default=1,
        help="every policy as this many independent router replicas, requests dealt in turn",
    )
    p.add_argument("--epsilon", type=float, default=ScoringConfig().epsilon, help="bounded load")
    p.add_argument(
        "--decision-picks",
        type=int,
        default=DEFAULT_DECISION_PICKS,
        help="picks timed with 64 endpoints (0: skip)",
    )
    p.add_argument(
        "--overload",
        type=float,
        default=1.5,
        help="the admission rows' load, times the fleet's prefill capacity (0: no admission rows)",
    )
    p.add_argument("--quick", action="store_true", help="the first 1,000 requests, fewer picks")
    return p


def _usage_error(args: argparse.Namespace, policies: Sequence[str]) -> str | None:
    """What is wrong with the flags beyond what argparse checks (None: nothing)."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        return f"--policies: unknown {unknown or 'empty'} (known: {', '.join(POLICIES)})"
    if args.overload < 0:
        return "--overload must not be negative"
    if args.epsilon < 0:
        return "--epsilon must not be negative"
    return None


def _replay_policies(
    trace: Sequence[TraceRequest],
    policies: Sequence[str],
    args: argparse.Namespace,
    config: ScoringConfig,
) -> list[Result]:
    """One result row per policy, each replay's time told on stderr."""
    results = []
    for name in policies:
        began = time.perf_counter()
        results.append(
            replay(
                trace,
                name,
                pods=args.pods,
                kv_blocks=args.kv_blocks,
                prefill_rate=args.prefill_rate,
                scrape_interval=args.gie_refresh if name == "gie-like" else args.scrape_interval,
                config=config,
                replicas=args.replicas,
            )
        )
        print(
            f"routing: {name}: {len(trace)} requests in {time.perf_counter() - began:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return results


def _admission(args: argparse.Namespace, limit: int | None) -> list[dict[str, Any]]:
    """The admission rows at ``--overload`` (none at 0)."""
    if args.overload <= 0:
        return []
    rows = admission_rows(
        args.trace,
        pods=args.pods,
        kv_blocks=args.kv_blocks,
        prefill_rate=args.prefill_rate,
        overload=args.overload,
        limit=limit,
    )
    print(
        f"routing: admission at {args.overload:g}x overload replayed", file=sys.stderr, flush=True
    )
    return rows


@dataclass(frozen=True)
class _Report:
    """Everything one run measured, as the table and the JSON show it."""

    trace: Sequence[TraceRequest]
    results: list[Result]
    decision: DecisionBench | None
    admission: list[dict[str, Any]]
    met: dict[str, bool]


def _print_report(args: argparse.Namespace, report: _Report) -> None:
    trace, decision = report.trace, report.decision
    print(
        f"{len(trace)} requests over {trace[-1].arrival:.0f} s, {args.pods} pods x"
        f" {args.kv_blocks} blocks, {args.prefill_rate:g} tokens/s, speed {args.speed:g}"
        + (f", {args.replicas} router replicas" if args.replicas > 1 else "")
    )
    print(table(report.results))
    if decision is not None:
        print(
            f"pick() with {decision.endpoints} endpoints: wall p50 {decision.pick_p50_us:.0f} us,"
            f" p99 {decision.pick_p99_us:.0f} us; CPU p50 {decision.pick_cpu_p50_us:.0f} us,"
            f" p99 {decision.pick_cpu_p99_us:.0f} us;"
            f" index {decision.index_bytes_per_block:.0f} bytes/block"
        )
    if report.admission:
        print(f"\nclass-aware admission, {args.overload:g}x the fleet's prefill capacity:")
        print(admission_table(report.admission))
    for name, ok in report.met.items():
        print(f"target {name}: {'met' if ok else 'MISSED'}")


def _payload(args: argparse.Namespace, report: _Report) -> dict[str, Any]:
    """The ``--json`` document."""
    decision = report.decision
    return {
        "results": [
            {
                "policy": r.policy,
                "kv_hit": r.kv_hit,
                "ttft_mean": r.ttft_mean,
                "ttft_p50": r.ttft_p50,
                "ttft_p95": r.ttft_p95,
                "ttft_p99": r.ttft_p99,
                "max_load_ratio": r.max_load_ratio,
            }
            for r in report.results
        ],
        "settings": {
            "trace": str(args.trace),
            "requests": len(report.trace),
            "pods": args.pods,
            "kv_blocks": args.kv_blocks,
            "prefill_rate": args.prefill_rate,
            "speed": args.speed,
            "scrape_interval": args.scrape_interval,
            "gie_refresh": args.gie_refresh,
            "epsilon": args.epsilon,
            "replicas": args.replicas,
        },
        "decision": None
        if decision is None
        else {
            "endpoints": decision.endpoints,
            "picks": decision.picks,
            "pick_p50_us": decision.pick_p50_us,
            "pick_p99_us": decision.pick_p99_us,
            "pick_cpu_p50_us": decision.pick_cpu_p50_us,
            "pick_cpu_p99_us": decision.pick_cpu_p99_us,
            "index_bytes_per_block": decision.index_bytes_per_block,
        },
        "admission": report.admission,
        "targets": report.met,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--live" in argv:  # real vLLM servers: a mode of its own (routing_live.py)
        from cachefleet_bench import routing_live

        return routing_live.main(argv)
    args = _parser().parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    error = _usage_error(args, policies)
    if error is not None:
        print(f"cachefleet bench routing: {error}", file=sys.stderr)
        return 2
    limit = args.limit if args.limit is not None else (1000 if args.quick else None)
    picks = min(args.decision_picks, 1000) if args.quick else args.decision_picks
    try:
        trace = load_trace(args.trace, speed=args.speed, limit=limit)
    except TraceError as exc:
        print(f"cachefleet bench routing: {exc}", file=sys.stderr)
        return 2
    config = ScoringConfig(block_tokens=BLOCK_TOKENS, epsilon=args.epsilon)
    results = _replay_policies(trace, policies, args, config)
    decision = None
    if picks > 0:
        decision = decision_bench(trace, picks=picks, kv_blocks=args.kv_blocks, config=config)
        print("routing: decision latency measured", file=sys.stderr, flush=True)
    admission = _admission(args, limit)
    met = {**targets(results, decision), **admission_targets(admission)}
    report = _Report(trace, results, decision, admission, met)
    _print_report(args, report)
    if args.json is not None:
        args.json.write_text(json.dumps(_payload(args, report), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
