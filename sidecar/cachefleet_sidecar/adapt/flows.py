"""Flows: which queue a parked request waits in, and the weighted fair order across them.

Pure: no I/O, no clock of its own (deadlines and ``now`` come in). The admission
core (:mod:`cachefleet_sidecar.adapt.admission`) parks Standard requests in a
:class:`FairQueue`; the router reads the same headers with the same rules
(:func:`fairness_id`).

A request's *flow* is its tenant, and within the tenant its fairness id: the
value of GIE's ``x-gateway-inference-fairness-id`` header when one is given
(docs/admission.md, "Fair queuing"), else the tenant's own default flow.
The queue is fair at two levels:

* between tenants, weighted: each tenant's share of the releases is its
  ``fairnessWeight`` over the weights of the tenants waiting;
* within a tenant, equal between its fairness ids; first come, first served
  within one fairness id.

A fairness id only ever divides its own tenant's share: a client that sends a
thousand fairness ids gets no more than its tenant's weight, and one that
sends another tenant's id only queues beside its own tenant's requests.

The order is start-time fair queuing (Goyal, Vin and Cheng, 1996) at each
level: a flow that starts waiting gets the start tag ``max(V, its last
finish)``, the flow with the least start tag goes next (ties: the earliest
arrival), its finish is ``start + 1 / weight``, and ``V`` moves to the start
tag just served. Chosen over deficit round robin because its unit is one
request with any real weight (DRR needs a quantum per round and loops over
rounds for fractional weights), a newly waiting flow is served within one
request of every other flow's turn (no waiting for the round to come by),
and an idle flow keeps no credit (``max(V, ...)``). The unit of fairness is
a release (a request let go upstream), as in GIE's round-robin fairness
policy: the gate does not know a request's cost before it runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from cachefleet_common.classes import MAX_FAIRNESS_ID, pairs

#: A tenant's weight when nothing says one (every tenant equal).
DEFAULT_WEIGHT = 1.0
#: Bounds a weight is taken within (the CRD allows (0, 1000]).
MIN_WEIGHT = 0.001
MAX_WEIGHT = 1000.0
#: Idle flows whose last finish tag is remembered, per level (beyond: the oldest forgotten).
MAX_IDLE_FLOWS = 4096

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def fairness_id(value: bytes | str | None) -> str:
    """The fairness id of a header value: printable ASCII, at most :data:`MAX_FAIRNESS_ID`
    characters, surrounding spaces dropped; anything else (or nothing) is "" (the tenant's
    own flow)."""
    if value is None:
        return ""
    text = value.decode("latin-1") if isinstance(value, bytes | bytearray) else value
    text = text.strip()
    if not text or len(text) > MAX_FAIRNESS_ID or not all(" " <= c <= "~" for c in text):
        return ""
    return text


def bounded_weight(weight: float | None) -> float:
    """``weight`` within [:data:`MIN_WEIGHT`, :data:`MAX_WEIGHT`]; None or NaN: the default."""
    if weight is None or weight != weight:  # NaN
        return DEFAULT_WEIGHT
    return min(MAX_WEIGHT, max(MIN_WEIGHT, float(weight)))


def parse_weights(text: str) -> dict[str, float]:
    """``tenant=weight,...`` (the sidecar's and the router's flag): weights in (0, 1000]."""
    out: dict[str, float] = {}
    for name, value in pairs(text).items():
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"{name}: the weight must be a number, got {value!r}") from None
        if not 0 < weight <= MAX_WEIGHT:
            raise ValueError(f"{name}: the weight must be in (0, {MAX_WEIGHT:g}], got {value}")
        out[name] = weight
    return out


@dataclass(frozen=True, slots=True)
class Flow:
    """Where a parked request waits: its tenant (weighted) and its fairness id in it."""

    tenant: str = ""
    fairness_id: str = ""
    weight: float = DEFAULT_WEIGHT


class _Tags(Generic[K]):
    """Start-time fair queuing tags of one level (tenants, or one tenant's fairness ids)."""

    __slots__ = ("finish", "start", "vtime")

    def __init__(self) -> None:
        self.vtime = 0.0
        #: waiting flows: the start tag of their next release
        self.start: dict[K, float] = {}
        #: idle flows: the finish tag of their last release (none: V)
        self.finish: dict[K, float] = {}

    def join(self, key: K) -> None:
        """``key`` starts waiting."""
        self.start[key] = max(self.vtime, self.finish.pop(key, 0.0))

    def served(self, key: K, weight: float, waiting: bool) -> None:
        """``key`` had one release; ``waiting``: it has more."""
        start = self.start.pop(key)
        self.vtime = max(self.vtime, start)
        finish = start + 1.0 / weight
        if waiting:
            self.start[key] = finish
        else:
            self._idle(key, finish)

    def leave(self, key: K) -> None:
        """``key`` stopped waiting without a release (expired, abandoned, evicted): uncharged."""
        self._idle(key, self.start.pop(key))

    def _idle(self, key: K, finish: float) -> None:
        if finish > self.vtime:  # at or below V it is the same as no entry
            self.finish[key] = finish
        if len(self.finish) > MAX_IDLE_FLOWS:
            self.finish = {k: f for k, f in self.finish.items() if f > self.vtime}
            while len(self.finish) > MAX_IDLE_FLOWS:  # forget the oldest: fairness, not safety
                del self.finish[next(iter(self.finish))]


@dataclass(slots=True, eq=False)
class _Entry(Generic[T]):
    seq: int
    deadline: float
    item: T
    tenant: str
    sub: str
    #: still parked (a left entry stays in the arrival order until it reaches its front)
    alive: bool = True


@dataclass(slots=True)
class _Tenant(Generic[T]):
    weight: float
    subs: dict[str, deque[_Entry[T]]] = field(default_factory=dict)
    tags: _Tags[str] = field(default_factory=_Tags)
    count: int = 0

    def head_seq(self) -> int:
        return min(q[0].seq for q in self.subs.values())


class FairQueue(Generic[T]):
    """Parked items in weighted fair order between tenants, fair between a tenant's
    fairness ids, FIFO within one (see the module doc). Items are compared by identity."""

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant[T]] = {}
        self._tags: _Tags[str] = _Tags()
        self._seq = 0
        self._len = 0
        #: every entry in arrival (= deadline) order; entries that left are skipped
        self._arrivals: deque[_Entry[T]] = deque()
        self._left = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def queued(self, tenant: str) -> int:
        """Items of ``tenant`` waiting."""
        state = self._tenants.get(tenant)
        return 0 if state is None else state.count

    @property
    def tenants(self) -> int:
        """Tenants with items waiting."""
        return len(self._tenants)

    # ------------------------------------------------------------------ in
    def push(self, item: T, flow: Flow, deadline: float) -> None:
        """Park ``item`` in ``flow`` until :meth:`pop` hands it out or ``deadline`` passes."""
        weight = bounded_weight(flow.weight)
        state = self._tenants.get(flow.tenant)
        if state is None:
            state = self._tenants[flow.tenant] = _Tenant(weight)
            self._tags.join(flow.tenant)
        state.weight = weight  # the newest word on the tenant's weight
        sub = state.subs.get(flow.fairness_id)
        if sub is None:
            sub = state.subs[flow.fairness_id] = deque()
            state.tags.join(flow.fairness_id)
        self._seq += 1
        entry = _Entry(self._seq, deadline, item, flow.tenant, flow.fairness_id)
        sub.append(entry)
        self._arrivals.append(entry)
        state.count += 1
        self._len += 1

    # ----------------------------------------------------------------- out
    def pop(self) -> T | None:
        """The next item in fair order (None: nothing waits)."""
        if not self._tenants:
            return None
        tags = self._tags
        name = min(tags.start, key=lambda t: (tags.start[t], self._tenants[t].head_seq()))
        state = self._tenants[name]
        inner = state.tags
        sub_id = min(inner.start, key=lambda s: (inner.start[s], state.subs[s][0].seq))
        sub = state.subs[sub_id]
        entry = sub.popleft()
        self._gone(entry)
        inner.served(sub_id, 1.0, bool(sub))
        if not sub:
            del state.subs[sub_id]
        state.count -= 1
        self._len -= 1
        tags.served(name, state.weight, state.count > 0)
        if state.count == 0:
            del self._tenants[name]
        self._idle_reset()
        return entry.item

    def expire(self, now: float) -> list[T]:
        """Items whose deadline is at or before ``now``, oldest first (deadlines are taken
        to grow with arrival, as admission's do). O(1) per item: the oldest parked item is
        the head of its fairness id's FIFO."""
        out: list[T] = []
        while self._arrivals:  # not held in a local: _gone may compact it
            entry = self._arrivals[0]
            if not entry.alive:
                self._arrivals.popleft()
                self._left -= 1
                continue
            if entry.deadline > now:
                break
            state = self._tenants[entry.tenant]
            sub = state.subs[entry.sub]
            assert sub[0] is entry  # FIFO within a fairness id
            sub.popleft()
            self._gone(entry)
            self._drop(entry.tenant, state, entry.sub, sub)
            out.append(entry.item)
        return out

    def remove(self, item: T) -> bool:
        """Take ``item`` out without a release; False when it is not parked."""
        for name, state in self._tenants.items():
            for sub_id, sub in state.subs.items():
                for entry in sub:
                    if entry.item is item:
                        sub.remove(entry)
                        self._gone(entry)
                        self._drop(name, state, sub_id, sub)
                        return True
        return False

    def evict_for(self, flow: Flow) -> T | None:
        """The queue is full and ``flow``'s tenant wants a place: the item that gives it up.

        The newest item of the longest fairness id of the tenant that holds the most
        places for its weight, when that is more than ``flow``'s tenant would hold with
        the newcomer (so a burst never keeps another tenant out); else None (the
        newcomer is the one refused).
        """
        if not self._tenants:
            return None
        weight = bounded_weight(flow.weight)
        mine = (self.queued(flow.tenant) + 1) / weight
        name, state = max(self._tenants.items(), key=lambda kv: kv[1].count / kv[1].weight)
        if state.count / state.weight <= mine:
            return None
        sub_id, sub = max(state.subs.items(), key=lambda kv: (len(kv[1]), kv[1][-1].seq))
        entry = sub.pop()
        self._gone(entry)
        self._drop(name, state, sub_id, sub)
        return entry.item

    def drain(self) -> list[T]:
        """Every item, in arrival order; the queue is empty after."""
        entries = [e for s in self._tenants.values() for q in s.subs.values() for e in q]
        entries.sort(key=lambda e: e.seq)
        self._tenants.clear()
        self._len = 0
        self._idle_reset()
        return [e.item for e in entries]

    def _gone(self, entry: _Entry[T]) -> None:
        """``entry`` left its fairness id's FIFO; the arrival order forgets it lazily
        (compacted when the entries that left outnumber those parked)."""
        entry.alive = False
        self._left += 1
        if self._left > 64 and self._left > self._len:
            self._arrivals = deque(e for e in self._arrivals if e.alive)
            self._left = 0

    def _drop(self, name: str, state: _Tenant[T], sub_id: str, sub: deque[_Entry[T]]) -> None:
        """One item of ``sub`` left without a release."""
        state.count -= 1
        self._len -= 1
        if not sub:
            del state.subs[sub_id]
            state.tags.leave(sub_id)
        if state.count == 0:
            del self._tenants[name]
            self._tags.leave(name)
        self._idle_reset()

    def _idle_reset(self) -> None:
        """Nothing waits: a new busy period starts from V = 0 with no history."""
        if self._len == 0:
            self._tags = _Tags()
            self._tenants.clear()
            self._arrivals.clear()
            self._left = 0
