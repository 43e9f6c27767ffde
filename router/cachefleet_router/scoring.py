"""Choosing an endpoint by expected time to first token (the router's scoring core).

Pure: no I/O, no asyncio; the clock is injected. The router's ``default``
profile on the scheduling seam (:mod:`cachefleet_router.schedule`):
:class:`TtftModel` keeps what is known of each endpoint, the scorers
:class:`QueueWait` (``wait``) and :class:`PrefixPrefill` (``work``) give
seconds, the filter :class:`BoundedLoad` and the picker :class:`LeastTtft`
choose; :class:`ScoringPicker` runs them (:data:`DEFAULT_PROFILE`). For each
ready endpoint ``e`` and a request of ``T`` prompt tokens whose first ``m``
blocks the endpoint's :class:`~cachefleet_router.prefix.PrefixIndex` holds::

    uncached(e)  = T - min(T, trust(e) * block_tokens * m)
    work(e)      = uncached(e) / rate(e)                       seconds of prefill
    wait(e)      = max(own(e), queue(e) + routed_since_scrape(e) / rate(e))
    ttft(e)      = wait(e) + work(e)

* ``own(e)``: the prefill work this picker sent to ``e`` and has not seen
  :meth:`~ScoringPicker.done` (first answer bytes), minus what the oldest of it
  has already run, in seconds at ``rate(e)``.
* ``queue(e)``: what the model server says when its metrics are fresh (scraped
  within ``stale_after_s``): ``(waiting + running_weight * running)`` requests
  of the mean work this picker routes per request. It covers what other router
  replicas sent; ``routed_since_scrape`` adds what this one sent since and has
  not seen done (a request that finished before the next scrape is no longer
  queued anywhere: counting it would push a conversation's quick turns away);
  for the same reason the requests of this picker that the scrape saw (routed
  before it) and that are done since are taken out of the server's count.
* ``rate(e)``: uncached prompt tokens per second of prefill, measured between
  scrapes from ``prompt_tokens_total`` minus prefix hits over
  ``prefill_seconds_total`` (decayed sums); until measured, the mean of the
  endpoints measured, else ``default_rate``.
* ``trust(e)``: how far the server's measured prefix hit ratio (``prefix
  hits / queries`` between scrapes, or SGLang's own ratio) agrees with what the
  index predicted for the requests routed there; bounded to
  ``[trust_min, trust_max]``.
* precise: where a :class:`PreciseIndex` (the servers' own KV events,
  :mod:`cachefleet_router.kvindex`) knows ``e``'s state and the request carries
  its token ids, the matched tokens are what ``e`` holds, exactly: no trust
  factor, no home credit.

Bounded load: an endpoint whose ``wait`` is above ``(1 + epsilon)`` times the
mean ``wait`` over the endpoints is not a candidate (when every endpoint is
idle all are). Among candidates the least ``ttft`` wins; the endpoints
within ``tie_rel`` / ``tie_abs_s`` of it tie, and a tie goes to the endpoint
whose sidecar L1 was last sent the same ``answer_key`` (it holds the exact
answer), then the least ``wait``, then the address.

Saturation (every endpoint's ``wait`` at least ``saturated_wait_s``):
``Guaranteed`` ignores the bounded-load cap (the least ``ttft`` anywhere), and
``BestEffort`` goes to the least-loaded endpoint, keeping the endpoints that
hold its prefix for the others.

Home: rendezvous hashing of the prompt's block ``home_block`` (4: the first
2,560 tokens with 512-token blocks) names one endpoint among the ready ones,
the same in every router replica. The picker believes the home holds the
prompt's first ``home_block + 1`` blocks, so a family of prompts nobody has
routed yet settles on its home, and so do the other replicas' requests of
that family. When the metrics show that this picker routes less than
``replicated_below_share`` of the endpoints' prompt tokens (its share, from
``prompt_tokens_total``), other replicas route a conversation's other turns:
the home is then believed to hold all but the prompt's last block.

Router replicas never need to agree: each learns from what it routes and
what the metrics say, and a restart loses only the index.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cachefleet_router.affinity import (
    DEFAULT_LORA_LOAD_S,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_TTL_S,
    affinity_parts,
)
from cachefleet_router.endpoints import (
    DEFAULT_BLOCK_TOKENS,
    Decision,
    Endpoint,
    EndpointMetrics,
    RouteRequest,
)
from cachefleet_router.prefix import DEFAULT_INDEX_BLOCKS, PrefixIndex, capacity_blocks
from cachefleet_router.schedule import Candidate, Cycle, Profile, ProfilePicker

#: done requests remembered per endpoint (to take them out of a scrape that saw them)
_RECENT_DONE = 64

#: decisions whose endpoints place a prompt family nobody holds (the fewest picks there)
_RECENT_PICKS = 256
#: a measured prefill rate stays within this factor of the other endpoints' mean
_RATE_BAND = 2.0

GUARANTEED = "Guaranteed"
BEST_EFFORT = "BestEffort"

#: Why an endpoint was chosen (a bounded set: the router's decisions metric labels by it):
#: the least expected TTFT under the bounded-load cap; every endpoint saturated and a
#: Guaranteed request, so the least expected TTFT anywhere; saturated and BestEffort, so
#: the least-loaded endpoint.
REASON_TTFT = "ttft"
REASON_SATURATED_GUARANTEED = "saturated-guaranteed"
REASON_SATURATED_BEST_EFFORT = "saturated-besteffort"


@dataclass(frozen=True, slots=True)
class ScoringConfig:
    """The picker's parameters (docs/routing.md says how each was chosen)."""

    #: tokens per block of :attr:`RouteRequest.blocks`
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    #: prefill rate, uncached tokens/s, of an endpoint not measured yet
    default_rate: float = 10_000.0
    #: index capacity in blocks of an endpoint whose metrics do not give its KV capacity
    default_index_blocks: int = DEFAULT_INDEX_BLOCKS
    #: bounded load: no candidate above (1 + epsilon) x the mean wait
    epsilon: float = 0.5
    #: ... plus this many typical requests' prefill (the cap of an idle fleet is not zero)
    load_slack_requests: float = 2.0
    #: home: the endpoint that rendezvous hashing of the prompt's block ``home_block`` names
    #: is believed to hold its first ``home_block + 1`` blocks (-1: no home), so that router
    #: replicas that share nothing still send a conversation's turns to one endpoint
    home_block: int = 4
    #: when this picker routes less than this share of the endpoints' prompt tokens (other
    #: replicas route the rest), the home is believed to hold all of a prompt but its last block
    replicated_below_share: float = 0.75
    #: metrics older than this (seconds) are ignored: the endpoint's queue is only what
    #: this picker sent there
    stale_after_s: float = 2.0
    #: weight of a running request in the server's queue (it is part-way through)
    running_weight: float = 0.5
    #: per scrape, the share of the measured rate's and hit ratios' history forgotten (0..1]
    smoothing: float = 0.1
    #: bounds of the index's trust factor
    trust_min: float = 0.25
    trust_max: float = 1.25
    #: the predicted hit ratio below which the trust factor is not updated (nothing to judge)
    trust_min_predicted: float = 0.02
    #: ties: within tie_rel of the best expected TTFT, or tie_abs_s seconds
    tie_rel: float = 0.02
    tie_abs_s: float = 0.002
    #: every endpoint's wait at least this (seconds): saturated; classes decide
    saturated_wait_s: float = 2.0
    #: answer keys remembered per endpoint (the sidecar L1 tie-break)
    answer_keys: int = 4096
    #: a routed request never reported done is forgotten after this (seconds)
    outstanding_ttl_s: float = 120.0
    #: an endpoint not offered for this long loses its state (index included)
    forget_after_s: float = 600.0
    #: affinity (cachefleet_router.affinity): seconds one LoRA adapter load costs; a session
    #: not seen for session_ttl_s starts afresh; sessions remembered at most (LRU)
    lora_load_s: float = DEFAULT_LORA_LOAD_S
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    max_sessions: int = DEFAULT_MAX_SESSIONS

    def __post_init__(self) -> None:
        positive = {
            "block_tokens": self.block_tokens,
            "default_rate": self.default_rate,
            "default_index_blocks": self.default_index_blocks,
            "stale_after_s": self.stale_after_s,
            "answer_keys": self.answer_keys,
            "outstanding_ttl_s": self.outstanding_ttl_s,
            "forget_after_s": self.forget_after_s,
            "trust_min": self.trust_min,
            "session_ttl_s": self.session_ttl_s,
            "max_sessions": self.max_sessions,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"ScoringConfig.{name} must be positive, not {value}")
        for name, value in {
            "epsilon": self.epsilon,
            "load_slack_requests": self.load_slack_requests,
            "replicated_below_share": self.replicated_below_share,
            "running_weight": self.running_weight,
            "tie_rel": self.tie_rel,
            "tie_abs_s": self.tie_abs_s,
            "saturated_wait_s": self.saturated_wait_s,
            "trust_min_predicted": self.trust_min_predicted,
            "lora_load_s": self.lora_load_s,
        }.items():
            if value < 0:
                raise ValueError(f"ScoringConfig.{name} must not be negative, not {value}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"ScoringConfig.smoothing must be in (0, 1], not {self.smoothing}")
        if self.trust_max < self.trust_min:
            raise ValueError("ScoringConfig.trust_max must not be below trust_min")


@dataclass(slots=True)
class _Routed:
    """One request this picker sent to an endpoint and has not seen done."""

    seq: int
    tokens: float  # predicted uncached tokens
    at: float
    #: the scrape count of its endpoint when it was routed (routed since the last scrape)
    epoch: int = 0
    #: its prompt's blocks, counted in the endpoint's ``pending`` while in flight
    #: (kept only when a precise index is in use)
    blocks: tuple[int, ...] = ()


@dataclass(slots=True)
class _EndpointState:
    """What the picker knows of one endpoint beyond its latest metrics."""

    index: PrefixIndex
    rate: float
    measured_rate: bool = False
    trust: float = 1.0
    outstanding: OrderedDict[int, _Routed] = field(default_factory=OrderedDict)
    outstanding_tokens: float = 0.0
    #: blocks of the prompts in flight here (routed, not done): the server will hold them by
    #: the time a request sent now runs, though its KV events cannot say so yet
    pending: dict[int, int] = field(default_factory=dict)
    #: when the endpoint last finished a request of ours (the head's start, at the earliest)
    last_done_at: float = 0.0
    #: uncached tokens routed here since the last scrape this picker saw, not done yet
    routed_since_scrape: float = 0.0
    #: scrapes this picker has learned from (the epoch of what is routed now)
    scrapes: int = 0
    #: the scrape the counters below come from
    scraped_at: float = 0.0
    prev: EndpointMetrics | None = None
    #: predicted prefix-hit tokens and routed tokens since the last scrape (raw index)
    pred_hits: float = 0.0
    pred_tokens: float = 0.0
    #: prompt tokens routed here since the last scrape
    mine_tokens: float = 0.0
    #: decayed sums: measured hit tokens / looked-up tokens, predicted ones, and the
    #: uncached tokens / prefill seconds behind the rate
    meas_hits: float = 0.0
    meas_tokens: float = 0.0
    pred_sum_hits: float = 0.0
    pred_sum_tokens: float = 0.0
    rate_tokens: float = 0.0
    rate_seconds: float = 0.0
    answers: OrderedDict[str, None] = field(default_factory=OrderedDict)
    seen_at: float = 0.0
    #: (routed at, done at) of this picker's recent requests here: one routed before the
    #: latest scrape and done after it is in that scrape's queue but no longer queued
    recent_done: list[tuple[float, float]] = field(default_factory=list)


class PreciseIndex(Protocol):
    """What the endpoints' own KV events say they hold (:mod:`cachefleet_router.kvindex`)."""

    def matched(self, address: str, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """(leading blocks, their tokens) of ``token_ids`` that ``address`` holds; None when
        the endpoint's state is not known (no events yet, or a gap since)."""
        ...


class TtftModel:
    """What the TTFT scorers know of each endpoint: the state behind ``wait`` and ``rate``.

    A stateful part of the default profile (:data:`DEFAULT_PROFILE`): ``prepare``
    refreshes each candidate's state once per cycle (new scrapes teach the rate and
    the trust factor) and computes its wait; ``picked`` records the routed request;
    ``done`` frees its outstanding work.
    """

    def __init__(
        self,
        config: ScoringConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or ScoringConfig()
        self._clock = clock
        self._states: dict[str, _EndpointState] = {}
        #: id(decision) -> (decision kept alive, address, seq)
        self._pending: dict[int, tuple[Decision, str, int]] = {}
        self._seq = 0
        #: smoothed uncached tokens per routed request (a server's queued request costs this)
        self._mean_request_tokens = 0.0
        self._last_sweep = 0.0
        #: decayed sums: prompt tokens this picker routed, and the servers' prompt tokens
        self._mine_tokens = 0.0
        self._server_tokens = 0.0
        #: sum and number of the measured prefill rates (an unmeasured endpoint gets the mean)
        self._measured_sum = 0.0
        self._measured_count = 0
        #: keep the blocks of the prompts in flight per endpoint (the precise scorer's bridge
        #: between routing a prompt and the server's events saying it holds it)
        self.track_pending = False
        #: the endpoints of the last :data:`_RECENT_PICKS` decisions, and their counts
        self._recent: deque[str] = deque(maxlen=_RECENT_PICKS)
        self._recent_counts: Counter[str] = Counter()

    # -- the seam's hooks ------------------------------------------------------------------

    def prepare(self, cycle: Cycle, candidates: list[Candidate]) -> None:
        now = cycle.now
        self._sweep(now)
        cycle.home = self._home(cycle.request, [c.endpoint for c in candidates])
        for c in candidates:
            c.state = self._state(c.endpoint, now)
            c.share = self.traffic_share()
            c.wait = self._wait(c.state, c.endpoint, now)

    def picked(self, cycle: Cycle, chosen: Candidate, decision: Decision) -> None:
        self._record(cycle.request, chosen, cycle.now, decision)

    def done(self, decision: Decision, request: RouteRequest, *, ok: bool) -> None:
        """Free the request's outstanding work on its endpoint (``ok`` or not).

        ``decision`` must be the object :meth:`pick` returned (it is looked up by
        identity); an unknown or repeated one is ignored. The index keeps the prompt's
        blocks either way: a failure after the prefill leaves them on the server, and a
        wrong belief is corrected by the trust factor and aged out by the LRU.
        """
        pending = self._pending.pop(id(decision), None)
        if pending is None or pending[0] is not decision:
            return
        _decision, address, seq = pending
        state = self._states.get(address)
        if state is None:
            return
        routed = state.outstanding.pop(seq, None)
        if routed is not None:
            _forget(state, routed)
            state.last_done_at = max(state.last_done_at, self._clock())
            state.recent_done.append((routed.at, state.last_done_at))
            if len(state.recent_done) > _RECENT_DONE:
                del state.recent_done[0]
        if not state.outstanding:
            state.outstanding_tokens = 0.0
            state.routed_since_scrape = 0.0

    # -- introspection (metrics, logs, tests) ----------------------------------------------

    def index(self, address: str) -> PrefixIndex | None:
        """The prefix index of ``address`` (None: never routed to or forgotten)."""
        state = self._states.get(address)
        return state.index if state is not None else None

    def rate(self, address: str) -> float:
        """The prefill rate the picker assumes for ``address``, tokens/s."""
        state = self._states.get(address)
        return state.rate if state is not None else self.config.default_rate

    def trust(self, address: str) -> float:
        """The index's trust factor on ``address`` (1: the server agrees with the index)."""
        state = self._states.get(address)
        return state.trust if state is not None else 1.0

    def outstanding(self, address: str) -> int:
        """Requests routed to ``address`` and not yet done."""
        state = self._states.get(address)
        return len(state.outstanding) if state is not None else 0

    def traffic_share(self) -> float:
        """The share of the endpoints' prompt tokens this picker routed (1: alone, or unknown)."""
        if self._server_tokens <= 0:
            return 1.0
        return min(1.0, self._mine_tokens / self._server_tokens)

    def expected_wait(self, endpoint: Endpoint) -> float:
        """Seconds a request sent to ``endpoint`` now would queue before its prefill."""
        now = self._clock()
        return self._wait(self._state(endpoint, now), endpoint, now)

    def in_flight_matched(self, address: str, blocks: Sequence[int]) -> int:
        """Leading ``blocks`` that a prompt in flight to ``address`` shares (0: none)."""
        state = self._states.get(address)
        if state is None or not state.pending:
            return 0
        n = 0
        for block in blocks:
            if block not in state.pending:
                break
            n += 1
        return n

    def recent_picks(self, address: str) -> int:
        """Of this picker's last :data:`_RECENT_PICKS` decisions, those for ``address``."""
        return self._recent_counts.get(address, 0)

    def mean_request_tokens(self) -> float:
        """The smoothed uncached tokens of a routed request (a typical request's prefill)."""
        return self._mean_request_tokens

    # -- internals -------------------------------------------------------------------------

    def _state(self, endpoint: Endpoint, now: float) -> _EndpointState:
        cfg = self.config
        state = self._states.get(endpoint.address)
        if state is None:
            capacity = capacity_blocks(endpoint.metrics, cfg.block_tokens, cfg.default_index_blocks)
            state = _EndpointState(index=PrefixIndex(capacity), rate=cfg.default_rate)
            self._states[endpoint.address] = state
        state.seen_at = now
        if not state.measured_rate and self._measured_count:
            # not measured yet: as fast as the fleet's measured endpoints, not the default
            # (an endpoint guessed slow would never be sent the traffic that measures it)
            state.rate = self._measured_sum / self._measured_count
        if (
            endpoint.metrics is not None
            and endpoint.scraped_at > 0
            and endpoint.scraped_at != state.scraped_at
        ):
            self._learn(state, endpoint.metrics, endpoint.scraped_at)
        return state

    def _learn(self, state: _EndpointState, metrics: EndpointMetrics, scraped_at: float) -> None:
        """A new scrape: the index's bound, the prefill rate and the trust factor."""
        cfg = self.config
        capacity = capacity_blocks(metrics, cfg.block_tokens, cfg.default_index_blocks)
        if capacity != state.index.capacity:
            state.index.resize(capacity)
        prev = state.prev
        keep = 1.0 - cfg.smoothing
        meas_ratio: float | None = None
        weight = 0.0
        if prev is not None:
            d_prompt = _delta(metrics.prompt_tokens_total, prev.prompt_tokens_total)
            d_queries = _delta(metrics.prefix_queries_total, prev.prefix_queries_total)
            d_hits = _delta(metrics.prefix_hits_total, prev.prefix_hits_total)
            d_seconds = _delta(metrics.prefill_seconds_total, prev.prefill_seconds_total)
            if d_queries is not None and d_hits is not None and d_queries > 0:
                meas_ratio = min(1.0, max(0.0, d_hits / d_queries))
                weight = d_queries
            elif metrics.prefix_hit_ratio is not None and d_prompt:
                meas_ratio = min(1.0, max(0.0, metrics.prefix_hit_ratio))
                weight = d_prompt
            if d_prompt is not None:
                forget = cfg.smoothing / max(1, len(self._states))
                self._mine_tokens = (1 - forget) * self._mine_tokens + state.mine_tokens
                self._server_tokens = (1 - forget) * self._server_tokens + d_prompt
            if d_prompt and d_seconds and d_seconds > 0:
                uncached = d_prompt * (1.0 - meas_ratio) if meas_ratio is not None else d_prompt
                # ratio of decayed sums: robust to a counter that moves a scrape before another
                state.rate_tokens = keep * state.rate_tokens + uncached
                state.rate_seconds = keep * state.rate_seconds + d_seconds
                if state.rate_tokens > 0 and state.rate_seconds > 0:
                    if state.measured_rate:
                        self._measured_sum -= state.rate
                        self._measured_count -= 1
                    state.rate = state.rate_tokens / state.rate_seconds
                    if self._measured_count:
                        # within _RATE_BAND of the others' mean: a per-request overhead counts
                        # as slow prefill, so the server that hits more (fewer uncached tokens
                        # per request) measured slowest and lost its conversations (three
                        # real vLLM servers: rates 16,000 to 53,000 tokens/s, one model)
                        mean = self._measured_sum / self._measured_count
                        state.rate = min(max(state.rate, mean / _RATE_BAND), mean * _RATE_BAND)
                    self._measured_count += 1
                    state.measured_rate = True
                    self._measured_sum += state.rate
        if meas_ratio is not None and state.pred_tokens > 0:
            state.meas_hits = keep * state.meas_hits + meas_ratio * weight
            state.meas_tokens = keep * state.meas_tokens + weight
            state.pred_sum_hits = keep * state.pred_sum_hits + state.pred_hits
            state.pred_sum_tokens = keep * state.pred_sum_tokens + state.pred_tokens
            predicted = state.pred_sum_hits / state.pred_sum_tokens
            if predicted >= cfg.trust_min_predicted and state.meas_tokens > 0:
                trust = (state.meas_hits / state.meas_tokens) / predicted
                state.trust = min(cfg.trust_max, max(cfg.trust_min, trust))
        if meas_ratio is not None or prev is None:
            state.pred_hits = 0.0
            state.pred_tokens = 0.0
        state.mine_tokens = 0.0
        state.prev = metrics
        state.scraped_at = scraped_at
        state.routed_since_scrape = 0.0
        state.scrapes += 1

    def _wait(self, state: _EndpointState, endpoint: Endpoint, now: float) -> float:
        cfg = self.config
        own = 0.0
        if state.outstanding:
            head = next(iter(state.outstanding.values()))
            started = max(head.at, state.last_done_at)
            head_left = max(0.0, head.tokens - max(0.0, now - started) * state.rate)
            own = (state.outstanding_tokens - head.tokens + head_left) / state.rate
        metrics = endpoint.metrics
        if (
            metrics is None
            or endpoint.scraped_at <= 0
            or now - endpoint.scraped_at > cfg.stale_after_s
        ):
            return own
        queued = metrics.waiting + cfg.running_weight * metrics.running
        # our requests the scrape saw queued or running that are done since: not queued now
        # (else a conversation's next turn, sent right after the answer, sees its own last
        # turn as the server's queue and moves: tests/vllm/test_router_vllm.py)
        scraped = endpoint.scraped_at
        state.recent_done = [(at, end) for at, end in state.recent_done if end > scraped]
        gone = sum(1 for at, _end in state.recent_done if at < scraped)
        queued = max(0.0, queued - gone * max(cfg.running_weight, 0.0))
        # before this picker has routed anything, a queued request counts one block of prefill:
        # the server's own queue still orders the endpoints
        per_request = self._mean_request_tokens or float(cfg.block_tokens)
        reported = (queued * per_request + state.routed_since_scrape) / state.rate
        return max(own, reported)

    def _home(self, request: RouteRequest, ready: Sequence[Endpoint]) -> str | None:
        """The endpoint every replica sends this prompt's family to when it knows no better."""
        k = self.config.home_block
        if k < 0 or len(request.blocks) <= k:
            return None
        key = request.blocks[k] & 0xFFFFFFFFFFFFFFFF
        best: tuple[int, str] | None = None
        for e in ready:
            mixed = ((key ^ _address_hash(e.address)) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
            mixed ^= mixed >> 29
            if best is None or (mixed, e.address) > best:
                best = (mixed, e.address)
        return best[1] if best is not None else None

    def _record(
        self, request: RouteRequest, chosen: Candidate, now: float, decision: Decision
    ) -> None:
        cfg = self.config
        state = chosen.state
        self._seq += 1
        seq = self._seq
        if not state.outstanding:
            state.last_done_at = now
        pending = request.blocks if self.track_pending else ()
        state.outstanding[seq] = _Routed(seq, chosen.uncached, now, state.scrapes, pending)
        if len(self._recent) == self._recent.maxlen:
            self._recent_counts[self._recent[0]] -= 1
        self._recent.append(chosen.endpoint.address)
        self._recent_counts[chosen.endpoint.address] += 1
        for block in pending:
            state.pending[block] = state.pending.get(block, 0) + 1
        state.outstanding_tokens += chosen.uncached
        state.routed_since_scrape += chosen.uncached
        tokens = float(max(request.tokens, 0))
        state.pred_hits += min(tokens, cfg.block_tokens * chosen.approx_matched)
        state.pred_tokens += tokens
        state.mine_tokens += tokens
        self._mean_request_tokens = _smooth(
            self._mean_request_tokens if self._seq > 1 else None, chosen.uncached, 0.05
        )
        if request.blocks:
            state.index.insert(request.blocks)
        key = request.answer_key
        if key is not None:
            state.answers[key] = None
            state.answers.move_to_end(key)
            while len(state.answers) > cfg.answer_keys:
                state.answers.popitem(last=False)
        self._pending[id(decision)] = (decision, chosen.endpoint.address, seq)

    def _sweep(self, now: float) -> None:
        """Forget requests never reported done, and endpoints long gone (bounded memory)."""
        cfg = self.config
        if now - self._last_sweep < min(cfg.outstanding_ttl_s, cfg.forget_after_s) / 4:
            return
        self._last_sweep = now
        for address, state in list(self._states.items()):
            if now - state.seen_at > cfg.forget_after_s:
                del self._states[address]
                if state.measured_rate:
                    self._measured_sum -= state.rate
                    self._measured_count -= 1
                continue
            while state.outstanding:
                head = next(iter(state.outstanding.values()))
                if now - head.at <= cfg.outstanding_ttl_s:
                    break
                state.outstanding.popitem(last=False)
                _forget(state, head)
        live = {(a, seq) for a, s in self._states.items() for seq in s.outstanding}
        for key, (_decision, address, seq) in list(self._pending.items()):
            if (address, seq) not in live:
                del self._pending[key]


# -- the TTFT model's parts (registered by name in cachefleet_router.profiles) ----------


class QueueWait:
    """Scorer ``queue-wait``: seconds a request sent to the candidate would queue."""

    def score(self, cycle: Cycle, candidates: Sequence[Candidate]) -> list[float]:
        return [c.wait for c in candidates]


class PrefixPrefill:
    """Scorer ``prefix-prefill``: seconds of prefill left after the prefix the endpoint holds.

    The prefix the endpoint holds comes from its own KV events when a
    :class:`PreciseIndex` is given and knows the endpoint's state (the request
    then carries its token ids): exact, so no trust factor; the prompts this
    router sent there and has not seen done count too (a queued prompt's blocks
    are not in the server's events until it runs), and the home keeps its
    ``home_block + 1`` blocks of credit (where a family nobody holds settles).
    Otherwise from the
    approximate :class:`~cachefleet_router.prefix.PrefixIndex` of what this
    router sent there, with the home's credit, times the trust factor.
    """

    def __init__(self, model: TtftModel, precise: PreciseIndex | None = None) -> None:
        self.model = model
        self.precise = precise
        if precise is not None:
            model.track_pending = True

    def score(self, cycle: Cycle, candidates: Sequence[Candidate]) -> list[float]:
        cfg = self.model.config
        request = cycle.request
        tokens = float(max(request.tokens, 0))
        out: list[float] = []
        for c in candidates:
            state = c.state
            matched = state.index.matched(request.blocks) if request.blocks else 0
            if c.endpoint.address == cycle.home:
                # the home holds the blocks up to home_block if anyone sent it this family; when
                # other replicas route most of the traffic, it likely holds all but the new turn
                credit = cfg.home_block + 1
                if c.share < cfg.replicated_below_share:
                    credit = max(credit, len(request.blocks) - 1)
                matched = max(matched, credit)
            c.matched = c.approx_matched = matched
            exact = None
            if self.precise is not None and request.token_ids:
                exact = self.precise.matched(c.endpoint.address, request.token_ids)
            if exact is not None:
                # what the server holds, or will hold once the prompts in flight there ran
                flying = self.model.in_flight_matched(c.endpoint.address, request.blocks)
                if c.endpoint.address == cycle.home:
                    # not a belief about its cache: where a family nobody holds settles,
                    # the same in every replica (docs/routing.md: measured with and without)
                    flying = max(flying, cfg.home_block + 1)
                held = float(exact[1])
                c.matched = exact[0]
                if cfg.block_tokens * flying > held:
                    held = float(cfg.block_tokens * flying)
                    c.matched = flying
                hit = min(tokens, held)
            else:
                hit = min(tokens, state.trust * cfg.block_tokens * matched)
            c.uncached = tokens - hit
            out.append(c.uncached / state.rate)
        return out


class BoundedLoad:
    """Filter ``bounded-load``: no candidate above the cap on wait; classes when saturated.

    The cap is ``(1 + epsilon)`` x the mean wait plus ``load_slack_requests`` typical
    requests' prefill. When every candidate's wait is at least ``saturated_wait_s``,
    ``BestEffort`` keeps only the least-loaded and ``Guaranteed`` keeps all.
    """

    def __init__(self, model: TtftModel) -> None:
        self.model = model

    def filter(self, cycle: Cycle, candidates: list[Candidate]) -> list[Candidate]:
        cfg = self.model.config
        mean_wait = sum(c.wait for c in candidates) / len(candidates)
        typical = self.model.mean_request_tokens() / (
            sum(c.state.rate for c in candidates) / len(candidates)
        )
        cap = (1.0 + cfg.epsilon) * mean_wait + cfg.load_slack_requests * typical
        saturated = all(c.wait >= cfg.saturated_wait_s for c in candidates)
        priority = cycle.request.priority_class
        if saturated and priority == BEST_EFFORT:
            least = min(c.wait for c in candidates)
            cycle.reason = REASON_SATURATED_BEST_EFFORT
            return [c for c in candidates if c.wait <= least]
        if saturated and priority == GUARANTEED:
            cycle.reason = REASON_SATURATED_GUARANTEED
            return candidates
        cycle.reason = REASON_TTFT
        return [c for c in candidates if c.wait <= cap]


class LeastTtft:
    """Picker ``least-ttft``: the least cost; near-ties to the sidecar holding the answer.

    Candidates within ``tie_rel`` / ``tie_abs_s`` of the best tie; a tie goes to the
    endpoint whose sidecar was last sent the request's answer key, then the least
    wait, then the address (deterministic).
    """

    def __init__(self, model: TtftModel) -> None:
        self.model = model

    def choose(self, cycle: Cycle, candidates: list[Candidate]) -> Candidate:
        cfg = self.model.config
        if len(candidates) > 1 and not any(c.matched for c in candidates):
            # a prompt nobody holds starts a family where it will stay: placed by the fewest
            # recent picks, not by a few ms of prefill rate (the fastest idle server drew every
            # new conversation: 6/38/16 and 0/60/0 requests on three real vLLM servers,
            # tests/vllm/test_routing_live_vllm.py); then the least cost, then the address
            fewest = min(self.model.recent_picks(c.endpoint.address) for c in candidates)
            candidates = [
                c for c in candidates if self.model.recent_picks(c.endpoint.address) == fewest
            ]
        best = min(c.cost for c in candidates)
        limit = best * (1.0 + cfg.tie_rel) + cfg.tie_abs_s
        tied = [c for c in candidates if c.cost <= limit]
        key = cycle.request.answer_key
        chosen = min(
            tied,
            key=lambda c: (
                not (key is not None and key in c.state.answers),
                c.wait,
                c.endpoint.address,
            ),
        )
        if key is not None and key in chosen.state.answers and len(tied) > 1:
            cycle.reason = (cycle.reason or REASON_TTFT) + "; tie to the sidecar holding the answer"
        return chosen


#: The router's default profile: the least expected TTFT under a bounded load. The affinity
#: parts (cachefleet_router.affinity) change nothing for a request that names no LoRA adapter
#: and carries no session.
DEFAULT_PROFILE = Profile(
    name="default",
    scorers=(("queue-wait", 1.0), ("prefix-prefill", 1.0), ("lora-affinity", 1.0)),
    filters=("bounded-load", "session-affinity"),
    picker="least-ttft",
    seconds=True,
    reason=REASON_TTFT,
    doc="the least expected time to first token (queue wait + prefill of what the endpoint "
    "does not hold + loading the request's LoRA adapter), under a bounded load; a session "
    "stays on its endpoint while that is under the cap; precise from KV events where known",
)


def ttft_parts(model: TtftModel, precise: PreciseIndex | None = None) -> dict[str, object]:
    """The TTFT model's parts by registered name, sharing ``model``."""
    return {
        "queue-wait": QueueWait(),
        "prefix-prefill": PrefixPrefill(model, precise),
        "bounded-load": BoundedLoad(model),
        "least-ttft": LeastTtft(model),
    }


class ScoringPicker(ProfilePicker):
    """The default profile (:data:`DEFAULT_PROFILE`) with its model's introspection.

    ``precise``: the endpoints' KV-event index, when the router subscribes to it.
    """

    def __init__(
        self,
        config: ScoringConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        precise: PreciseIndex | None = None,
        profile: Profile = DEFAULT_PROFILE,
    ) -> None:
        self.model = TtftModel(config, clock=clock)
        self.config = self.model.config
        parts = {
            **ttft_parts(self.model, precise),
            **affinity_parts(
                self.config.lora_load_s, self.config.session_ttl_s, self.config.max_sessions
            ),
        }
        super().__init__(profile, parts, clock=clock, hooks=[self.model])

    def index(self, address: str) -> PrefixIndex | None:
        """The prefix index of ``address`` (None: never routed to or forgotten)."""
        return self.model.index(address)

    def rate(self, address: str) -> float:
        """The prefill rate the picker assumes for ``address``, tokens/s."""
        return self.model.rate(address)

    def trust(self, address: str) -> float:
        """The index's trust factor on ``address`` (1: the server agrees with the index)."""
        return self.model.trust(address)

    def outstanding(self, address: str) -> int:
        """Requests routed to ``address`` and not yet done."""
        return self.model.outstanding(address)

    def traffic_share(self) -> float:
        """The share of the endpoints' prompt tokens this picker routed (1: alone, or unknown)."""
        return self.model.traffic_share()

    def expected_wait(self, endpoint: Endpoint) -> float:
        """Seconds a request sent to ``endpoint`` now would queue before its prefill."""
        return self.model.expected_wait(endpoint)


def _forget(state: _EndpointState, routed: _Routed) -> None:
    """``routed`` no longer weighs on its endpoint (done, or never reported and expired)."""
    state.outstanding_tokens = max(0.0, state.outstanding_tokens - routed.tokens)
    if routed.epoch == state.scrapes:  # routed since the last scrape: the metrics miss it
        state.routed_since_scrape = max(0.0, state.routed_since_scrape - routed.tokens)
    for block in routed.blocks:
        left = state.pending.get(block, 0) - 1
        if left > 0:
            state.pending[block] = left
        else:
            state.pending.pop(block, None)


_ADDRESS_HASHES: dict[str, int] = {}


def _address_hash(address: str) -> int:
    """A hash of an address that every process computes alike (``hash(str)`` is salted)."""
    value = _ADDRESS_HASHES.get(address)
    if value is None:
        value = zlib.crc32(address.encode()) * 0x100000001B3 & 0xFFFFFFFFFFFFFFFF
        if len(_ADDRESS_HASHES) < 65_536:
            _ADDRESS_HASHES[address] = value
    return value


def _delta(new: float | None, old: float | None) -> float | None:
    """A counter's increase between two scrapes; None when unknown or reset."""
    if new is None or old is None or new < old:
        return None
    return new - old


def _smooth(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new
