"""The scheduling seam: scorers, filters and a picker, run as one named profile.

Pure: no I/O, no clock of its own. The shape is that of the Gateway API
Inference Extension's scheduling framework (filters, scorers, a picker, each
registered by name and composed into profiles by configuration), with one
difference that keeps cachefleet's model: a scorer returns a **cost** per
candidate, lower is better, and the TTFT scorers speak seconds of expected
time to first token (queue wait, prefill), so that a profile of them adds up
to an expected TTFT rather than a unit-free mix. Scorers ported from GIE
(whose scores are in [0, 1], higher better) return ``1 - score``: with the
profile's weights, the least weighted cost is exactly GIE's highest weighted
score.

One scheduling cycle (:meth:`ProfilePicker.pick`):

1. every part with a ``prepare`` hook sees the cycle and the candidates (a
   stateful model refreshes what it knows of each endpoint, once);
2. each scorer gives a cost per candidate; a candidate's ``cost`` is the
   weighted sum, in the profile's order;
3. the filters narrow the candidates, seeing the costs (a bounded-load cap is
   a filter on the expected wait); a filter may set the cycle's ``reason``;
4. the picker chooses one;
5. parts with a ``picked`` hook record the choice; ``done`` hooks hear when
   the request's first answer bytes came back.

The registry of named parts and the built-in profiles are in
:mod:`cachefleet_router.profiles`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .endpoints import Decision, Endpoint, RouteRequest


@dataclass(slots=True)
class Candidate:
    """One ready endpoint during a cycle, with what the parts found out about it."""

    endpoint: Endpoint
    #: the weighted sum of the scorers' costs (seconds for the TTFT scorers)
    cost: float = 0.0
    #: seconds a request sent here now would queue before its prefill (the TTFT model's)
    wait: float = 0.0
    #: leading blocks of the prompt believed held (the Decision reports it)
    matched: int = 0
    #: ... in the approximate index's blocks (what the trust factor learns from)
    approx_matched: int = 0
    #: prompt tokens left to prefill here
    uncached: float = 0.0
    #: the traffic share the TTFT model measured when it refreshed this endpoint
    share: float = 1.0
    #: a stateful model's record of this endpoint (opaque to the seam)
    state: Any = None


@dataclass(slots=True)
class Cycle:
    """One request's scheduling cycle."""

    request: RouteRequest
    now: float
    #: why the chosen endpoint was chosen (filters and the picker add to it)
    reason: str = ""
    #: the endpoint the request's prompt family settles on when nobody knows better
    home: str | None = None
    #: scratch space for parts (keyed by the part's name)
    notes: dict[str, Any] = field(default_factory=dict)


class Scorer(Protocol):
    """A cost per candidate, lower is better, in the candidates' order."""

    def score(self, cycle: Cycle, candidates: Sequence[Candidate]) -> Sequence[float]: ...


class Filter(Protocol):
    """The candidates that stay (an empty answer keeps them all: never leave none)."""

    def filter(self, cycle: Cycle, candidates: list[Candidate]) -> list[Candidate]: ...


class Chooser(Protocol):
    """The profile's picker: one of the candidates (never called with none)."""

    def choose(self, cycle: Cycle, candidates: list[Candidate]) -> Candidate: ...


@runtime_checkable
class Prepares(Protocol):
    def prepare(self, cycle: Cycle, candidates: list[Candidate]) -> None: ...


@runtime_checkable
class RecordsPicks(Protocol):
    def picked(self, cycle: Cycle, chosen: Candidate, decision: Decision) -> None: ...


@runtime_checkable
class HearsDone(Protocol):
    def done(self, decision: Decision, request: RouteRequest, *, ok: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class Profile:
    """A named composition of registered parts (:mod:`cachefleet_router.profiles`)."""

    name: str
    #: (scorer name, weight), summed in this order
    scorers: tuple[tuple[str, float], ...] = ()
    filters: tuple[str, ...] = ()
    picker: str = "least-cost"
    #: the costs are seconds of expected TTFT (the Decision then reports the chosen cost)
    seconds: bool = False
    #: the reason a decision carries when no part gave one
    reason: str = ""
    doc: str = ""


class ProfilePicker:
    """A :class:`~cachefleet_router.endpoints.Picker` running one profile's parts.

    ``parts``: registered parts by name (the profile names the ones it uses);
    ``hooks``: stateful parts the profile does not name but whose hooks must run
    (a model the named scorers share). ValueError names a part that is missing.
    """

    def __init__(
        self,
        profile: Profile,
        parts: Mapping[str, object],
        *,
        clock: Callable[[], float],
        hooks: Sequence[object] = (),
    ) -> None:
        def part(name: str, kind: str) -> Any:
            found = parts.get(name)
            if found is None:
                known = ", ".join(sorted(parts))
                raise ValueError(
                    f"profile {profile.name!r}: no {kind} named {name!r} (known: {known})"
                )
            return found

        self.profile = profile
        self._scorers: list[tuple[Scorer, float]] = [
            (part(name, "scorer"), weight) for name, weight in profile.scorers
        ]
        self._filters: list[Filter] = [part(name, "filter") for name in profile.filters]
        self._chooser: Chooser = part(profile.picker, "picker")
        self._clock = clock
        used: list[object] = []
        for p in [*hooks, *(s for s, _ in self._scorers), *self._filters, self._chooser]:
            if not any(p is q for q in used):
                used.append(p)
        self._prepare = [p for p in used if isinstance(p, Prepares)]
        self._picked = [p for p in used if isinstance(p, RecordsPicks)]
        self._done = [p for p in used if isinstance(p, HearsDone)]

    def pick(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Decision | None:
        ready = [e for e in endpoints if e.ready]
        if not ready:
            return None
        cycle = Cycle(request, self._clock())
        candidates = [Candidate(e) for e in ready]
        for part in self._prepare:
            part.prepare(cycle, candidates)
        for scorer, weight in self._scorers:
            costs = scorer.score(cycle, candidates)
            for candidate, cost in zip(candidates, costs, strict=True):
                candidate.cost += weight * cost
        kept = candidates
        for flt in self._filters:
            kept = flt.filter(cycle, kept) or kept
        chosen = self._chooser.choose(cycle, kept)
        decision = Decision(
            address=chosen.endpoint.address,
            expected_ttft_s=chosen.cost if self.profile.seconds else 0.0,
            matched_blocks=chosen.matched,
            reason=cycle.reason or self.profile.reason,
        )
        for recorder in self._picked:
            recorder.picked(cycle, chosen, decision)
        return decision

    def done(self, decision: Decision, request: RouteRequest, *, ok: bool) -> None:
        for hearer in self._done:
            hearer.done(decision, request, ok=ok)
