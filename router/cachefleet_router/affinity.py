"""Affinity parts of the scheduling seam: a request's LoRA adapter, and an explicit session.

Pure: no I/O, no clock of its own (the cycle's ``now``). Both are registered by
name (:mod:`cachefleet_router.profiles`) and are part of the ``default`` profile;
where a request names no adapter and carries no session they change nothing.

* :class:`LoraAffinity`, scorer ``lora-affinity``: seconds to get the request's
  adapter onto the endpoint, from vLLM's ``vllm:lora_requests_info``
  (:attr:`~cachefleet_common.modelserver.ModelServerMetrics.lora_running`,
  ``lora_waiting``, ``lora_max``). The order is that of the Gateway API Inference
  Extension's ``lora-affinity-scorer``
  (``pkg/epp/scheduling/framework/plugins/scorer/lora_affinity.go``: 1 when the
  adapter is active, 0.8 when the server has a free adapter slot, 0.6 when the
  adapter is waiting there, 0 otherwise); here a cost in seconds,
  ``(1 - GIE's score) / 0.2 x load_s``: 0 where the adapter runs, one adapter
  load (``load_s``) where a slot is free, 2 loads where it waits for a slot,
  5 where every slot is taken by other adapters. A request names an adapter
  when its ``model`` is not the endpoint's base model (vLLM's ``model_name``
  label); an endpoint that exports no LoRA series costs nothing (LoRA off, or
  not vLLM). The bounded-load filter still applies: it caps on the queue wait,
  so an overloaded endpoint holding the adapter is not chosen.
* :class:`SessionAffinity`, filter ``session-affinity``: a request carrying a
  session (:attr:`~cachefleet_router.endpoints.RouteRequest.session`, the
  router's ``--session-header``) goes to the endpoint its session last went to,
  while that endpoint is among the candidates the filters before it kept (the
  default profile runs it after ``bounded-load``: a sticky endpoint over the cap
  is not used, and the session moves to the endpoint chosen instead). A session
  not seen for ``ttl_s`` starts afresh. Memory: at most ``max_sessions``
  sessions (LRU), each a 64-bit hash of the header's value and an address.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from .endpoints import Decision, EndpointMetrics
from .schedule import Candidate, Cycle

#: an adapter load's seconds by default (``--lora-load-seconds``): a guess of the order of
#: loading an adapter from the server's disk onto the GPU; set it from your servers' logs
DEFAULT_LORA_LOAD_S = 0.5
#: a session not seen for this long starts afresh (``--session-ttl``), seconds
DEFAULT_SESSION_TTL_S = 600.0
#: sessions remembered at most (LRU): about 220 bytes each (tracemalloc), 22 MB at the cap
DEFAULT_MAX_SESSIONS = 100_000
#: the Decision's reason when the session's endpoint was kept
REASON_SESSION = "session"

#: adapter loads a request costs: running, a free slot, waiting for a slot, no slot
_LOADS_RUNNING = 0.0
_LOADS_FREE_SLOT = 1.0
_LOADS_WAITING = 2.0
_LOADS_FULL = 5.0


def adapter_loads(model: str | None, metrics: EndpointMetrics | None) -> float:
    """Adapter loads (in units of one load) before ``model`` runs on an endpoint."""
    if not model or metrics is None or metrics.lora_running is None:
        return _LOADS_RUNNING  # no adapter named, or the endpoint says nothing of LoRA
    if model == metrics.model_name or model in metrics.lora_running:
        return _LOADS_RUNNING
    waiting = metrics.lora_waiting or frozenset()
    slots = metrics.lora_max
    if slots is None or len(metrics.lora_running) + len(waiting) < slots:
        return _LOADS_FREE_SLOT
    return _LOADS_WAITING if model in waiting else _LOADS_FULL


class LoraAffinity:
    """Scorer ``lora-affinity``: seconds to get the request's LoRA adapter onto the endpoint."""

    def __init__(self, load_s: float = DEFAULT_LORA_LOAD_S) -> None:
        if not load_s >= 0:
            raise ValueError(f"lora load seconds must not be negative, not {load_s}")
        self.load_s = load_s

    def score(self, cycle: Cycle, candidates: Sequence[Candidate]) -> list[float]:
        model = cycle.request.model
        if not model:
            return [0.0] * len(candidates)
        return [adapter_loads(model, c.endpoint.metrics) * self.load_s for c in candidates]


def session_key(session: str | None) -> int | None:
    """A 64-bit key of a session header's value (None: no session)."""
    if not session:
        return None
    digest = hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class SessionAffinity:
    """Filter ``session-affinity``: a session stays on its endpoint while it is a candidate."""

    def __init__(
        self, ttl_s: float = DEFAULT_SESSION_TTL_S, max_sessions: int = DEFAULT_MAX_SESSIONS
    ) -> None:
        if not ttl_s > 0 or max_sessions < 1:
            raise ValueError("session ttl must be positive and max sessions at least 1")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        #: session key -> (address, last seen)
        self._sessions: OrderedDict[int, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def endpoint(self, session: str, now: float) -> str | None:
        """Where ``session`` sticks now (None: nowhere, or expired)."""
        key = session_key(session)
        entry = self._sessions.get(key) if key is not None else None
        if entry is None or now - entry[1] > self.ttl_s:
            return None
        return entry[0]

    def filter(self, cycle: Cycle, candidates: list[Candidate]) -> list[Candidate]:
        session = cycle.request.session
        if not session:
            return candidates
        address = self.endpoint(session, cycle.now)
        if address is None:
            return candidates
        sticky = [c for c in candidates if c.endpoint.address == address]
        if sticky:
            cycle.reason = REASON_SESSION
            return sticky
        return candidates

    def picked(self, cycle: Cycle, chosen: Candidate, decision: Decision) -> None:
        key = session_key(cycle.request.session)
        if key is None:
            return
        self._sessions[key] = (decision.address, cycle.now)
        self._sessions.move_to_end(key)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)


def affinity_parts(
    lora_load_s: float = DEFAULT_LORA_LOAD_S,
    session_ttl_s: float = DEFAULT_SESSION_TTL_S,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
) -> dict[str, object]:
    """The affinity parts by registered name, fresh."""
    return {
        "lora-affinity": LoraAffinity(lora_load_s),
        "session-affinity": SessionAffinity(session_ttl_s, max_sessions),
    }
