"""Admission under overload: a Mooncake-format trace replayed through the real admission core.

The ``"admission"`` rows of ``cachefleet bench routing``. The trace
(``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of
512-token blocks) is replayed over ``pods`` simulated model servers, each an
LRU of ``kv_blocks`` blocks and a serial FIFO prefill queue; a request's time
to first token is its wait plus ``(input_length - 512 x leading blocks the pod
holds) / prefill_rate``. Deterministic: no clock, no randomness beyond the
``seed`` that salts the class assignment.

* **Load.** Timestamps are compressed so that the offered prefill work is
  ``overload`` x the fleet's capacity. The work is estimated with one
  fleet-wide LRU of ``pods x kv_blocks`` blocks (what perfect routing would
  reuse); response-cache hits are left out.
* **Tenants and classes** go with conversations, by a hash of the conversation
  (salted with ``seed``): 20 % Guaranteed, 50 % Standard, 30 % BestEffort. A
  conversation is its first block that is not a prefix many conversations
  share (:func:`cachefleet_bench.mooncake.conversation_ids`): in Mooncake's
  conversation trace every request starts with the same block, and classing
  by the first block gave every request one class (no Guaranteed traffic).
* **Response cache.** A request whose exact ``hash_ids`` sequence was seen
  before is a cache hit: answered by the sidecar, it never reaches a queue.
  Hits are still shown to admission (``hit=True``); ``hits_refused`` counts
  any it refused.
* **Routing.** Every request goes to the pod with the least expected TTFT
  (work queued there, parked work included, plus this prompt's uncached part).
* **Modes.** ``fifo``: every miss enters its pod's queue. ``class-aware``: each
  pod has its own :class:`cachefleet_sidecar.adapt.admission.Admission` (the
  sidecar's), fed a reading of that pod (waiting, running, KV use, prefill
  histogram) every ``poll_s`` seconds, as the sidecar's gate polls
  (:data:`cachefleet_sidecar.http.gate.METRICS_POLL_S`; the pods' polls are spread
  over the period). Parked Standard requests are released and timed out at
  readings, as the gate does; between readings the core decides from the last
  reading and what it sent since. ``poll_s=0`` reads at every arrival and
  completion instead: a poller with no delay, which no sidecar has
  (optimistic; the replay's first version). Refused requests are counted;
  released Standard requests enter the queue (their TTFT includes the wait).

Row fields: ``guaranteed_misses`` (Guaranteed requests that reached a queue:
0 means the row says nothing of Guaranteed), ``guaranteed_ttft_p95`` (seconds,
Guaranteed misses),
``guaranteed_ttft_p95_unloaded`` (the same requests replayed with no other
traffic), ``besteffort_shed_share`` (refused / BestEffort misses) and
``hits_refused``.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import sys
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachefleet_bench import mooncake
from cachefleet_bench.mooncake import BLOCK_TOKENS, DEFAULT_TRACE, TraceError
from cachefleet_common.classes import BEST_EFFORT, CLASSES, GUARANTEED, STANDARD
from cachefleet_common.modelserver import ModelServerMetrics
from cachefleet_sidecar.adapt.admission import Admission, AdmissionConfig
from cachefleet_sidecar.http.gate import METRICS_POLL_S

#: Class shares by conversation (the rest is BestEffort).
GUARANTEED_SHARE = 0.2
STANDARD_SHARE = 0.5
#: Thresholds of the replay's admission. A simulated pod prefills one request at a time,
#: so one running request is a full batch (``max_running=1``, as ``--max-num-seqs`` is for
#: vLLM) and any waiting request is queued work (``max_waiting=1``); a Standard request
#: waits up to 30 s of trace time.
REPLAY_ADMISSION = AdmissionConfig(
    max_waiting=1, max_running=1, standard_queue=64, standard_max_wait_s=30.0
)


@dataclass(slots=True)
class _Req:
    index: int
    ts_ms: float
    tokens: int
    blocks: tuple[int, ...]
    cls: str
    tenant: str
    hit: bool
    at: float = 0.0


@dataclass(slots=True)
class _Job:
    req: _Req
    estimate: float
    pod: int


@dataclass
class _Pod:
    capacity: int
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)
    queue: deque[_Job] = field(default_factory=deque)
    busy: _Job | None = None
    busy_until: float = 0.0
    busy_service: float = 0.0
    queued_work: float = 0.0
    parked_work: float = 0.0
    prefill_s: float = 0.0
    prefills: int = 0
    admission: Admission | None = None

    def matched(self, blocks: tuple[int, ...]) -> int:
        n = 0
        for b in blocks:
            if b not in self.lru:
                break
            n += 1
        return n

    def remember(self, blocks: tuple[int, ...]) -> None:
        for b in blocks:
            self.lru[b] = None
            self.lru.move_to_end(b)
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)

    def reading(self) -> ModelServerMetrics:
        held = 0 if self.busy is None else len(self.busy.req.blocks)
        return ModelServerMetrics(
            waiting=float(len(self.queue)),
            running=0.0 if self.busy is None else 1.0,
            kv_usage=min(1.0, held / self.capacity),
            prefill_seconds_total=self.prefill_s,
            prefill_requests_total=float(self.prefills),
            server="vllm",
        )


def uncached_s(tokens: int, matched: int, rate: float) -> float:
    return max(0, tokens - BLOCK_TOKENS * matched) / rate


def classify(conversation: int, seed: int) -> tuple[str, str]:
    """(class, tenant) of a conversation (:func:`cachefleet_bench.mooncake.conversation_ids`)."""
    digest = hashlib.blake2b(f"{seed}:{conversation}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2**64
    if u < GUARANTEED_SHARE:
        cls = GUARANTEED
    elif u < GUARANTEED_SHARE + STANDARD_SHARE:
        cls = STANDARD
    else:
        cls = BEST_EFFORT
    return cls, f"{cls.lower()}-{digest[0] % 4}"


def load_trace(path: str | Path, seed: int = 0, limit: int | None = None) -> list[_Req]:
    """The trace's requests in time order, classed and marked as hits or misses."""
    out: list[_Req] = []
    seen: set[tuple[int, ...]] = set()
    trace = mooncake.load_trace(Path(path), limit=limit)
    conversations = mooncake.conversation_ids([r.blocks for r in trace])
    for r, conversation in zip(trace, conversations, strict=True):
        if r.input_length < 1 or conversation is None:
            raise TraceError(
                f"{path}: request {len(out) + 1}: input_length >= 1 and hash_ids required"
            )
        cls, tenant = classify(conversation, seed)
        out.append(
            _Req(
                len(out),
                r.arrival * 1000.0,
                r.input_length,
                r.blocks,
                cls,
                tenant,
                r.blocks in seen,
            )
        )
        seen.add(r.blocks)
    if len(out) < 2:
        raise TraceError(f"{path}: fewer than 2 requests")
    return out


def fleet_work_s(reqs: Sequence[_Req], pods: int, kv_blocks: int, rate: float) -> float:
    """Prefill seconds the misses need with one fleet-wide LRU (perfect reuse)."""
    fleet = _Pod(pods * kv_blocks)
    work = 0.0
    for r in reqs:
        if not r.hit:
            work += uncached_s(r.tokens, fleet.matched(r.blocks), rate)
            fleet.remember(r.blocks)
    return work


def p95(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


@dataclass
class _Outcome:
    ttft: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CLASSES})
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    hits_refused: int = 0
    #: Standard requests refused after waiting their whole bound (503), of ``refused``.
    standard_timeouts: int = 0
    #: Per Guaranteed miss, by trace index: its TTFT, the rest of the prefill running
    #: on its pod when it arrived (it cannot be interrupted), that prefill's class,
    #: and its own prefill seconds.
    guaranteed: dict[int, float] = field(default_factory=dict)
    residual: dict[int, float] = field(default_factory=dict)
    residual_class: dict[int, str] = field(default_factory=dict)
    service: dict[int, float] = field(default_factory=dict)


class _Replay:
    """One replay in progress: the pods, the prefills ending and the pods' next readings.

    Events are taken in time order: a request's arrival first runs every prefill end
    and reading up to its time (:meth:`advance`).
    """

    def __init__(
        self,
        *,
        pods: int,
        kv_blocks: int,
        prefill_rate: float,
        admission: AdmissionConfig | None,
        poll_s: float,
    ) -> None:
        self.fleet = [_Pod(kv_blocks) for _ in range(pods)]
        if admission is not None:
            for pod in self.fleet:
                pod.admission = Admission(admission)
        self.prefill_rate = prefill_rate
        self.poll_s = poll_s
        self.out = _Outcome()
        self.done: list[tuple[float, int, int]] = []  # (time, sequence, pod): prefills ending
        self.seq = 0
        self.polled = admission is not None and poll_s > 0
        # (time, pod): each pod's next reading, the pods' phases spread over the period
        self.polls = [(poll_s * p / pods, p) for p in range(pods)] if self.polled else []

    def start(self, p: int, now: float) -> None:
        """The pod's next queued job starts its prefill when the pod is idle."""
        pod = self.fleet[p]
        if pod.busy is not None or not pod.queue:
            return
        job = pod.queue.popleft()
        pod.queued_work -= job.estimate
        service = uncached_s(job.req.tokens, pod.matched(job.req.blocks), self.prefill_rate)
        pod.busy, pod.busy_until, pod.busy_service = job, now + service, service
        if job.req.cls == GUARANTEED:
            self.out.service[job.req.index] = service
        self.seq += 1
        heapq.heappush(self.done, (pod.busy_until, self.seq, p))

    def enqueue(self, job: _Job, now: float) -> None:
        pod = self.fleet[job.pod]
        if job.req.cls == GUARANTEED and pod.busy is not None:
            self.out.residual[job.req.index] = pod.busy_until - now
            self.out.residual_class[job.req.index] = pod.busy.req.cls
        pod.queue.append(job)
        pod.queued_work += job.estimate
        self.start(job.pod, now)

    def tick(self, p: int, now: float) -> None:
        """The pod's sidecar takes a reading, lets parked requests go, times out the rest."""
        pod = self.fleet[p]
        if pod.admission is None:
            return
        pod.admission.observe(pod.reading(), now)
        for ticket in pod.admission.release():
            assert isinstance(ticket, _Job)
            pod.parked_work -= ticket.estimate
            self.enqueue(ticket, now)
        self.expire(p, now)

    def expire(self, p: int, now: float) -> None:
        pod = self.fleet[p]
        if pod.admission is not None and pod.admission.queued:
            for ticket in pod.admission.expire(now):
                assert isinstance(ticket, _Job)
                pod.parked_work -= ticket.estimate
                self.out.refused[ticket.req.cls] += 1
                self.out.standard_timeouts += 1

    def expire_all(self, now: float) -> None:
        """Without periodic readings, parked requests time out at every event."""
        if not self.polled:
            for p in range(len(self.fleet)):
                self.expire(p, now)

    def complete(self, now: float, p: int) -> None:
        pod = self.fleet[p]
        job = pod.busy
        assert job is not None
        pod.remember(job.req.blocks)
        pod.prefill_s += pod.busy_service
        pod.prefills += 1
        pod.busy = None
        self.out.ttft[job.req.cls].append(now - job.req.at)
        if job.req.cls == GUARANTEED:
            self.out.guaranteed[job.req.index] = now - job.req.at
        self.expire_all(now)
        self.start(p, now)
        if not self.polled:
            self.tick(p, now)

    def advance(self, t: float) -> None:
        """Every prefill end and reading up to ``t``, in time order."""
        done, polls = self.done, self.polls
        while True:
            t_done = done[0][0] if done else math.inf
            t_poll = polls[0][0] if polls else math.inf
            if min(t_done, t_poll) > t:
                return
            if t_done <= t_poll:
                now, _, p = heapq.heappop(done)
                self.complete(now, p)
            else:
                now, p = heapq.heappop(polls)
                self.tick(p, now)
                heapq.heappush(polls, (now + self.poll_s, p))

    def route(self, req: _Req, now: float) -> int:
        """The pod with the least expected TTFT for ``req``."""
        best, best_s = 0, math.inf
        for p, pod in enumerate(self.fleet):
            expected = (
                (max(0.0, pod.busy_until - now) if pod.busy is not None else 0.0)
                + pod.queued_work
                + (0.0 if req.cls == GUARANTEED else pod.parked_work)  # admitted before them
            )
            own = uncached_s(req.tokens, pod.matched(req.blocks), self.prefill_rate)
            if expected + own < best_s:
                best, best_s = p, expected + own
        return best

    def arrive(self, req: _Req) -> None:
        """A request arrives: a hit is only shown to admission; a miss is routed and
        admitted, parked or refused by its pod's admission (FIFO: admitted)."""
        self.advance(req.at)
        now = req.at
        self.expire_all(now)
        out = self.out
        if req.hit:
            adm = self.fleet[0].admission
            if adm is not None and adm.decide(req.cls, now, hit=True).action != "admit":
                out.hits_refused += 1
            return
        out.misses[req.cls] += 1
        best = self.route(req, now)
        pod = self.fleet[best]
        job = _Job(req, uncached_s(req.tokens, pod.matched(req.blocks), self.prefill_rate), best)
        if pod.admission is None:
            self.enqueue(job, now)
            return
        if not self.polled:
            self.tick(best, now)
        decision = pod.admission.decide(req.cls, now, job)
        if decision.action == "admit":
            self.enqueue(job, now)
        elif decision.action == "wait":
            pod.parked_work += job.estimate
        else:
            out.refused[req.cls] += 1

    def drain(self) -> None:
        """Readings go on until nothing is parked (each waits at most its bound) or running."""

        def parked() -> bool:
            return any(pod.admission is not None and pod.admission.queued for pod in self.fleet)

        done, polls = self.done, self.polls
        while done or (self.polled and parked()):
            t_next = min(done[0][0] if done else math.inf, polls[0][0] if polls else math.inf)
            self.advance(t_next)
        for pod in self.fleet:
            if pod.admission is not None:
                for ticket in pod.admission.release_all():  # none expected: counted if any
                    assert isinstance(ticket, _Job)
                    self.out.refused[ticket.req.cls] += 1


def replay(
    reqs: Sequence[_Req],
    *,
    pods: int,
    kv_blocks: int,
    prefill_rate: float,
    admission: AdmissionConfig | None,
    poll_s: float = METRICS_POLL_S,
) -> _Outcome:
    """One replay (``admission`` None: FIFO); requests need their ``at`` times set.

    ``poll_s``: seconds between two readings of a pod by its sidecar (0: a
    reading at every arrival and completion on that pod).
    """
    run = _Replay(
        pods=pods,
        kv_blocks=kv_blocks,
        prefill_rate=prefill_rate,
        admission=admission,
        poll_s=poll_s,
    )
    for req in reqs:
        run.arrive(req)
    run.drain()
    return run.out


def admission_rows(
    trace_path: str | Path,
    *,
    pods: int,
    kv_blocks: int,
    prefill_rate: float,
    overload: float = 1.5,
    seed: int = 0,
    limit: int | None = None,
    config: AdmissionConfig = REPLAY_ADMISSION,
    poll_s: float = METRICS_POLL_S,
    explain: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The ``fifo`` and ``class-aware`` rows of one trace at ``overload`` x capacity.

    ``explain``: a list that gets, per mode, what the rows leave out: Standard's
    outcome, and where Guaranteed's p95 comes from (:func:`_explain`).
    """
    if pods < 1:
        raise ValueError(f"pods: must be >= 1, got {pods}")
    if kv_blocks < 1:
        raise ValueError(f"kv_blocks: must be >= 1, got {kv_blocks}")
    if not (math.isfinite(prefill_rate) and prefill_rate > 0):
        raise ValueError(f"prefill_rate: must be > 0 tokens/s, got {prefill_rate}")
    if not (math.isfinite(overload) and overload > 0):
        raise ValueError(f"overload: must be > 0, got {overload}")
    if not (math.isfinite(poll_s) and poll_s >= 0):
        raise ValueError(f"poll_s: must be >= 0 seconds, got {poll_s}")
    reqs = load_trace(trace_path, seed, limit)
    span_s = (reqs[-1].ts_ms - reqs[0].ts_ms) / 1000.0
    work = fleet_work_s(reqs, pods, kv_blocks, prefill_rate)
    if span_s <= 0 or work <= 0:
        raise TraceError(f"{trace_path}: the trace spans no time or needs no prefill")
    # Compressed span: the work is `overload` x what `pods` can do in it.
    scale = (work / (pods * overload)) / span_s
    for r in reqs:
        r.at = (r.ts_ms - reqs[0].ts_ms) / 1000.0 * scale
    common: dict[str, Any] = {"pods": pods, "kv_blocks": kv_blocks, "prefill_rate": prefill_rate}
    guaranteed = [r for r in reqs if r.cls == GUARANTEED]
    alone = replay(guaranteed, admission=None, **common)
    unloaded = p95(alone.ttft[GUARANTEED])
    rows = []
    for mode, adm in (("fifo", None), ("class-aware", config)):
        result = replay(reqs, admission=adm, poll_s=poll_s, **common)
        if explain is not None:
            explain.append({"mode": mode, **_explain(result, alone, unloaded)})
        be = result.misses[BEST_EFFORT]
        rows.append(
            {
                "mode": mode,
                "guaranteed_misses": result.misses[GUARANTEED],
                "guaranteed_ttft_p95": round(p95(result.ttft[GUARANTEED]), 4),
                "guaranteed_ttft_p95_unloaded": round(unloaded, 4),
                "besteffort_shed_share": round(result.refused[BEST_EFFORT] / be, 4) if be else 0.0,
                "hits_refused": result.hits_refused,
            }
        )
    return rows


def admission_table(rows: Sequence[dict[str, Any]]) -> str:
    """The admission rows as the report prints them."""
    lines = [
        f"{'admission':<12} {'G misses':>9} {'G TTFT p95':>11} {'unloaded':>9} {'ratio':>6}"
        f" {'BE shed':>8} {'hits refused':>13}"
    ]
    for row in rows:
        base = row["guaranteed_ttft_p95_unloaded"]
        ratio = row["guaranteed_ttft_p95"] / base if base else float("nan")
        lines.append(
            f"{row['mode']:<12} {row.get('guaranteed_misses', 0):>9}"
            f" {row['guaranteed_ttft_p95']:>10.2f}s {base:>8.2f}s {ratio:>5.2f}x"
            f" {row['besteffort_shed_share']:>8.1%} {row['hits_refused']:>13}"
        )
    return "\n".join(lines)


def admission_targets(rows: Sequence[dict[str, Any]]) -> dict[str, bool]:
    """Issue 24's admission targets on the class-aware row."""
    aware = [r for r in rows if r["mode"] == "class-aware"]
    if not aware:
        return {}
    row = aware[0]
    return {
        # without Guaranteed traffic the row says nothing of it: not met
        "admission guaranteed p95 <= 1.2x unloaded": row.get("guaranteed_misses", 1) > 0
        and row["guaranteed_ttft_p95"] <= 1.2 * row["guaranteed_ttft_p95_unloaded"],
        "admission 0 hits refused": row["hits_refused"] == 0,
    }


def _explain(result: _Outcome, alone: _Outcome, unloaded: float) -> dict[str, Any]:
    """Standard's outcome and Guaranteed's p95 with each delay taken out, as x unloaded.

    ``no_residual``: TTFT less the rest of the prefill running when it arrived;
    ``own_prefill``: its prefill alone (no wait at all); ``unloaded_prefill``:
    its wait plus the prefill it had in the unloaded replay (the KV cache held
    by Guaranteed alone).
    """
    g = sorted(result.guaranteed)
    ttft = result.guaranteed
    waits = {i: ttft[i] - result.service[i] for i in g}

    def ratio(values: list[float]) -> float:
        return round(p95(values) / unloaded, 3) if unloaded else math.nan

    st = result.misses[STANDARD]
    return {
        "guaranteed_ratio": ratio([ttft[i] for i in g]),
        "no_residual": ratio([ttft[i] - result.residual.get(i, 0.0) for i in g]),
        "own_prefill": ratio([result.service[i] for i in g]),
        "unloaded_prefill": ratio([waits[i] + alone.service[i] for i in g if i in alone.service]),
        "guaranteed_meeting_a_running_standard": round(
            sum(1 for i in g if result.residual_class.get(i) == STANDARD) / len(g), 3
        )
        if g
        else 0.0,
        "standard_misses": st,
        "standard_refused_share": round(result.refused[STANDARD] / st, 3) if st else 0.0,
        "standard_timeouts": result.standard_timeouts,
        "standard_ttft_p95": round(p95(result.ttft[STANDARD]), 2),
        "besteffort_misses": result.misses[BEST_EFFORT],
        "besteffort_refused": result.refused[BEST_EFFORT],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="cachefleet-bench-admission", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--trace",
        type=mooncake.trace_path,
        default=DEFAULT_TRACE,
        help="Mooncake-format JSONL trace, plain or .gz, or a name: synthetic, conversation",
    )
    p.add_argument("--pods", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=1000, help="512-token blocks per pod")
    p.add_argument("--prefill-rate", type=float, default=20000.0, help="tokens/s per pod")
    p.add_argument("--overload", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--poll-s",
        type=float,
        default=METRICS_POLL_S,
        help="seconds between a sidecar's readings of its pod (0: at every event, optimistic)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="also print Standard's outcome and where Guaranteed's p95 comes from",
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--json", default=None, help="write {'admission': rows} here")
    args = p.parse_args(argv)
    explain: list[dict[str, Any]] | None = [] if args.explain else None
    try:
        rows = admission_rows(
            args.trace,
            pods=args.pods,
            kv_blocks=args.kv_blocks,
            prefill_rate=args.prefill_rate,
            overload=args.overload,
            seed=args.seed,
            limit=args.limit,
            poll_s=args.poll_s,
            explain=explain,
        )
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for row in rows:
        print(json.dumps(row))
    for detail in explain or ():
        print(json.dumps({"explain": detail}))
    if args.json:
        Path(args.json).write_text(json.dumps({"admission": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
