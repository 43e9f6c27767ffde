"""The registry of named scheduling parts, and the profiles the router runs (``--profile``).

Pure: no I/O. A profile (:class:`~cachefleet_router.schedule.Profile`) names
its scorers (with weights), filters and picker; :func:`build` makes a fresh
picker of it, with fresh parts (each picker owns its state). The profiles:

* ``default``: cachefleet's least expected time to first token under a
  bounded load (:data:`cachefleet_router.scoring.DEFAULT_PROFILE`): scorers
  ``queue-wait`` + ``prefix-prefill`` (seconds), filter ``bounded-load``,
  picker ``least-ttft``. Precise from the endpoints' KV events where the router
  has them, approximate elsewhere.
* ``least-loaded``: Envoy's least-request balancer as it runs by default
  (``LEAST_REQUEST``, ``selection_method: N_CHOICES``, ``choice_count`` 2; all
  hosts of equal weight): of two endpoints drawn at random (with replacement) the
  one with fewer requests this router has in flight, the first drawn on a tie
  (``unweightedHostPickNChoices`` in Envoy's
  ``source/extensions/load_balancing_policies/least_request/least_request_lb.cc``);
  seeded: scorer ``in-flight``, picker ``two-choices``. (``least-cost`` instead is
  Envoy's ``FULL_SCAN`` with ties to the lowest address rather than at random.)
* ``round-robin``: each ready endpoint in turn: picker ``round-robin``.
* ``gie-like``: the Gateway API Inference Extension's default profile, ported:
  ``queue-scorer`` weight 2, ``kv-cache-utilization-scorer`` weight 2,
  ``prefix-cache-scorer`` weight 3, ``max-score-picker`` (weights from GIE's
  chart, ``config/charts/inferencepool/templates/epp-config.yaml``; the scorers
  from ``pkg/epp/scheduling/framework/plugins/scorer/{queue,kvcache_utilization}.go``):
  queue = (max waiting - waiting) / (max - min) over the candidates (1 when all
  equal), KV = 1 - KV usage, prefix = leading blocks of the prompt its own LRU
  index of what it routed holds / the prompt's blocks; the highest weighted sum
  wins, ties chosen at random (seeded). GIE's scores run higher-better in
  [0, 1]; here each scorer's cost is ``1 - score``, so the least weighted cost
  is GIE's highest weighted score.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from .affinity import affinity_parts
from .endpoints import DEFAULT_BLOCK_TOKENS, Decision, Endpoint, RouteRequest
from .prefix import DEFAULT_INDEX_BLOCKS, PrefixIndex, capacity_blocks
from .schedule import Candidate, Cycle, Profile, ProfilePicker
from .scoring import (
    DEFAULT_PROFILE,
    PreciseIndex,
    ScoringConfig,
    ScoringPicker,
    TtftModel,
    ttft_parts,
)

REASON_LEAST_LOADED = "least-loaded"
REASON_ROUND_ROBIN = "round-robin"
REASON_GIE = "gie-like"

#: GIE's default profile's weights (its chart's epp-config.yaml)
GIE_QUEUE_WEIGHT = 2.0
GIE_KV_CACHE_WEIGHT = 2.0
GIE_PREFIX_WEIGHT = 3.0
#: costs closer than this tie (GIE compares float scores exactly; sums here may differ
#: from GIE's in the last bit)
_TIE = 1e-9


class InFlight:
    """Scorer ``in-flight``: requests this router sent to the endpoint and has not seen done."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}

    def count(self, address: str) -> int:
        return self._count.get(address, 0)

    def score(self, cycle: Cycle, candidates: Sequence[Candidate]) -> list[float]:
        return [float(self.count(c.endpoint.address)) for c in candidates]

    def picked(self, cycle: Cycle, chosen: Candidate, decision: Decision) -> None:
        self._count[decision.address] = self.count(decision.address) + 1

    def done(self, decision: Decision, request: RouteRequest, *, ok: bool) -> None:
        left = self.count(decision.address) - 1
        if left > 0:
            self._count[decision.address] = left
        else:
            self._count.pop(decision.address, None)


class LeastCost:
    """Picker ``least-cost``: the least cost, ties to the lowest address (deterministic)."""

    def choose(self, cycle: Cycle, candidates: list[Candidate]) -> Candidate:
        return min(candidates, key=lambda c: (c.cost, c.endpoint.address))


class TwoChoices:
    """Picker ``two-choices`` (Envoy's least-request, ``N_CHOICES``): the cheaper of ``choices``
    candidates drawn at random with replacement, the first drawn on a tie (seeded)."""

    def __init__(self, seed: int = 0, choices: int = 2) -> None:
        self._random = random.Random(seed)
        self.choices = max(1, choices)

    def choose(self, cycle: Cycle, candidates: list[Candidate]) -> Candidate:
        best = candidates[self._random.randrange(len(candidates))]
        for _ in range(self.choices - 1):
            drawn = candidates[self._random.randrange(len(candidates))]
            if drawn.cost < best.cost:
                best = drawn
        return best


class RoundRobin:
    """Picker ``round-robin``: the candidates in turn, in the order discovery lists them."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, cycle: Cycle, candidates: list[Candidate]) -> Candidate:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen


class GieQueue:
    """Scorer ``gie-queue`` (GIE's queue-scorer): waiting requests, min-max normalised."""

    def score(self, cycle: Cycle, candidates: Sequence[Candidate]) -> list[float]:
        waiting = [
            0.0 if c.endpoint.metrics is None else c.endpoint.metrics.waiting for c in candidates
        ]
        low, high = min(waiting), max(waiting)
        if high == low:
            return [0.0] * len(candidates)
        return [1.0 - (high - w) / (high - low) for w in waiting]


class GieKvCache:
    """Scorer ``gie-kv-cache`` (GIE's kv-cache-utilization-scorer): 1 - KV usage, as a cost."""

    def score(self, cycle: Cycle, candidates: Sequence[Candidate]) -> list[float]:
        out = []
        for c in candidates:
            usage = c.endpoint.metrics.kv_usage if c.endpoint.metrics is not None else None
            out.append(min(1.0, max(0.0, usage)) if usage is not None else 0.0)
        return out


class GiePrefix:
    """Scorer ``gie-prefix`` (GIE's prefix-cache-scorer): the share of the prompt's blocks held.

    Its own LRU index per endpoint of the prompts it routed there (GIE's
    approximate mode), bounded by the endpoint's KV capacity when its metrics say it.
    """

    def __init__(
        self, block_tokens: int = DEFAULT_BLOCK_TOKENS, default_blocks: int = DEFAULT_INDEX_BLOCKS
    ) -> None:
        self.block_tokens = block_tokens
        self.default_blocks = default_blocks
        self._index: dict[str, PrefixIndex] = {}

    def _of(self, endpoint: Endpoint) -> PrefixIndex:
        index = self._index.get(endpoint.address)
        if index is None:
            blocks = capacity_blocks(endpoint.metrics, self.block_tokens, self.default_blocks)
            index = self._index[endpoint.address] = PrefixIndex(blocks)
        return index

    def score(self, cycle: Cycle, candidates: Sequence[Candidate]) -> list[float]:
        blocks = cycle.request.blocks
        n = max(len(blocks), 1)
        out = []
        for c in candidates:
            c.matched = self._of(c.endpoint).matched(blocks)
            out.append(1.0 - c.matched / n)
        return out

    def picked(self, cycle: Cycle, chosen: Candidate, decision: Decision) -> None:
        if cycle.request.blocks:
            self._of(chosen.endpoint).insert(cycle.request.blocks)


class MaxScore:
    """Picker ``max-score`` (GIE's max-score-picker): the least cost, ties at random (seeded)."""

    def __init__(self, seed: int = 0) -> None:
        self._random = random.Random(seed)

    def choose(self, cycle: Cycle, candidates: list[Candidate]) -> Candidate:
        best = min(c.cost for c in candidates)
        tied = [c for c in candidates if c.cost <= best + _TIE]
        return tied[0] if len(tied) == 1 else self._random.choice(tied)


LEAST_LOADED = Profile(
    name="least-loaded",
    scorers=(("in-flight", 1.0),),
    picker="two-choices",
    reason=REASON_LEAST_LOADED,
    doc="Envoy's least-request by default: of two endpoints drawn at random, the one with "
    "fewer requests in flight from this router",
)
ROUND_ROBIN = Profile(
    name="round-robin",
    picker="round-robin",
    reason=REASON_ROUND_ROBIN,
    doc="each ready endpoint in turn",
)
GIE_LIKE = Profile(
    name="gie-like",
    scorers=(
        ("gie-queue", GIE_QUEUE_WEIGHT),
        ("gie-kv-cache", GIE_KV_CACHE_WEIGHT),
        ("gie-prefix", GIE_PREFIX_WEIGHT),
    ),
    picker="max-score",
    reason=REASON_GIE,
    doc="GIE's default profile: queue x2, KV-cache utilisation x2, prefix x3, max score",
)
#: the profiles ``--profile`` names
PROFILES: dict[str, Profile] = {
    p.name: p for p in (DEFAULT_PROFILE, LEAST_LOADED, ROUND_ROBIN, GIE_LIKE)
}


def parts(
    config: ScoringConfig,
    *,
    model: TtftModel | None = None,
    precise: PreciseIndex | None = None,
    seed: int = 0,
) -> dict[str, object]:
    """Every registered part by name, fresh (a picker's parts are its own)."""
    out: dict[str, object] = {
        "in-flight": InFlight(),
        "least-cost": LeastCost(),
        "two-choices": TwoChoices(seed),
        "round-robin": RoundRobin(),
        "gie-queue": GieQueue(),
        "gie-kv-cache": GieKvCache(),
        "gie-prefix": GiePrefix(config.block_tokens, config.default_index_blocks),
        "max-score": MaxScore(seed),
        **affinity_parts(config.lora_load_s, config.session_ttl_s, config.max_sessions),
    }
    if model is not None:
        out.update(ttft_parts(model, precise))
    return out


def build(
    name: str,
    config: ScoringConfig | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    precise: PreciseIndex | None = None,
    seed: int = 0,
) -> ProfilePicker:
    """A fresh picker running profile ``name``; ValueError names the known ones."""
    profile = PROFILES.get(name)
    if profile is None:
        raise ValueError(f"unknown profile {name!r} (known: {', '.join(PROFILES)})")
    config = config or ScoringConfig()
    if profile is DEFAULT_PROFILE:
        return ScoringPicker(config, clock=clock, precise=precise)
    model = TtftModel(config, clock=clock)
    uses_model = any(
        n in ttft_parts(model)
        for n in (*(s for s, _ in profile.scorers), *profile.filters, profile.picker)
    )
    return ProfilePicker(
        profile,
        parts(config, model=model, precise=precise, seed=seed),
        clock=clock,
        hooks=[model] if uses_model else [],
    )
