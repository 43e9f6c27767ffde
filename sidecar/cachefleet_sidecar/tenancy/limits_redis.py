"""Per-tenant rate limits at run time: one Redis script per request, a local share without it.

:class:`RateLimiter` is the request path's :class:`~cachefleet_sidecar.http.relay.RateGate`.
A request that goes to the model server (a miss, a bypass) is admitted by one
``EVALSHA`` of :data:`~cachefleet_common.contract.lua.RATE_LIMIT_LUA` on the
tenant's key (every sidecar of the cache shares it: the limits are fleet-wide);
the answer's ``usage`` corrects the token charge with a second, fire-and-forget
call. Cache hits never reach it, unless ``--limits-count-hits`` makes them count
as requests (never as tokens).

When Redis cannot be reached (or the sidecar has none) each pod decides alone with
the same arithmetic (:mod:`cachefleet_common.limits`) on its share of each
limit, limit / live pods (the members' heartbeats, counted while Redis answered;
the whole limit when never known), and ``/status`` says so. A limiter fault is
never the client's error. The limits come from ``--tenant-limits`` and from the
operator's quota table (which wins for the tenants it names).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import orjson
from prometheus_client.core import GaugeMetricFamily, Metric

from cachefleet_common import resp
from cachefleet_common.contract.lua import RATE_LIMIT_LUA
from cachefleet_common.contract.messages import QuotaAssignment
from cachefleet_common.contract.names import members_key, rate_limit_key
from cachefleet_common.limits import (
    BUCKETS,
    Decision,
    TenantLimits,
    decide,
    decision_of_reply,
    estimate_tokens,
    header_lines,
    refusal_message,
)
from cachefleet_sidecar.cache.entry import usage_of
from cachefleet_sidecar.http.server import simple_response
from cachefleet_sidecar.tasks import Background

log = logging.getLogger("cachefleet.sidecar")

#: Longest a request waits for the limiter's answer before its pod decides alone, seconds.
DEFAULT_TIMEOUT_S = 0.5
#: After a failed call the pod decides alone this long before it asks Redis again, seconds.
REDIS_RETRY_S = 1.0
#: How often the live pods are counted (from the heartbeats) while Redis answers, seconds.
MEMBERS_REFRESH_S = 10.0

_SCRIPT = resp.Script(RATE_LIMIT_LUA)
_PERIODS_MS = tuple(int(period * 1000) for _, _, period in BUCKETS)


@dataclasses.dataclass(slots=True, eq=False)
class Ticket:
    """One admission: what it charged, the headers it adds, its refusal (None: it may go)."""

    tenant: str
    #: Requests and tokens charged (undone or corrected by :meth:`RateLimiter.settle`).
    requests: int
    tokens: int
    decision: Decision
    #: The whole 429 answer when refused.
    refusal: bytes | None
    #: ``\\r\\nx-ratelimit-...: ...`` lines, written after the ``x-cache`` value.
    x_cache_tail: bytes
    settled: bool = False


def _tail(decision: Decision) -> bytes:
    return b"".join(b"\r\n%s: %s" % (n.encode(), v.encode()) for n, v in header_lines(decision))


class RateLimiter:
    """Fleet-wide request and token limits per tenant (docs/rate-limits.md)."""

    def __init__(
        self,
        cache: str,
        *,
        limits: Mapping[str, TenantLimits],
        client: resp.RespClient | None,
        background: Background,
        count_hits: bool = False,
        on_refused: Callable[[str, str], None] = lambda tenant, reason: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cache = cache
        #: ``--tenant-limits``: in force for every tenant the operator does not name.
        self.static = dict(limits)
        self.table: dict[str, TenantLimits] = dict(limits)
        self.client = client
        self.background = background
        #: ``--limits-count-hits``: cache hits count as requests (never as tokens).
        self.count_hits = count_hits
        self.on_refused = on_refused
        self.clock = clock
        self.timeout_s = DEFAULT_TIMEOUT_S
        #: Live sidecars of the cache when last counted (None: never counted).
        self.live_pods: int | None = None
        self._members_at = -math.inf
        self._down_until = -math.inf
        #: Why the last call to Redis failed ("" while it answers).
        self.redis_error = "" if client is not None else "no Redis configured"
        #: Local GCRA state per tenant (used while Redis cannot be reached).
        self._local: dict[str, list[float]] = {}
        #: The last decision per tenant (for /status), and counts.
        self.last: dict[str, Decision] = {}
        self.admitted: dict[str, int] = {}
        self.refused: dict[tuple[str, str], int] = {}
        self.local_decisions = 0
        self.corrections_failed = 0

    # ----------------------------------------------------------------- limits

    def limited(self, tenant: str) -> bool:
        """Whether ``tenant`` has limits (the request path asks only then)."""
        return tenant in self.table

    def apply(self, assignment: QuotaAssignment) -> None:
        """The operator's limits (its tenants' replace ``--tenant-limits``'s)."""
        table = {t: v for t, v in self.static.items() if t not in assignment.tenants}
        for tenant, quota in assignment.tenants.items():
            spec = quota.limits
            if spec is None:
                continue
            limits = TenantLimits(
                spec.requests_per_minute, spec.tokens_per_minute, spec.tokens_per_day
            )
            if limits:
                table[tenant] = limits
        self.table = table
        for gone in [t for t in self._local if t not in table]:
            del self._local[gone]
        for gone in [t for t in self.last if t not in table]:
            del self.last[gone]
            self.admitted.pop(gone, None)
        self.refused = {k: n for k, n in self.refused.items() if k[0] in table}

    @property
    def local(self) -> bool:
        """Whether this pod decides alone now (Redis unreachable, or none)."""
        return self.client is None or time.monotonic() < self._down_until

    def share_of(self) -> int:
        """The number of pods a limit is divided by while this pod decides alone."""
        return self.live_pods or 1

    # -------------------------------------------------------------- admission

    async def admit(
        self, tenant: str, body: bytes, *, request: bool = True, tokens: bool = True
    ) -> Ticket:
        """Charge a request about to reach the model server (``request``: count it; ``tokens``:
        charge its estimate); refused: nothing is charged and the ticket holds the 429."""
        limits = self.table.get(tenant)
        if limits is None:
            return Ticket(tenant, 0, 0, Decision(True, ()), None, b"")
        reqs = 1 if request and limits.requests_per_minute else 0
        cost = 0
        if tokens and (limits.tokens_per_minute or limits.tokens_per_day):
            cost = estimate_tokens(_parsed(body), len(body))
        if reqs == 0 and cost == 0:  # nothing to charge (a hit already counted, no token limit)
            return Ticket(tenant, 0, 0, Decision(True, ()), None, b"")
        decision = await self._decide(tenant, limits, "take", reqs, cost)
        self.last[tenant] = decision
        if decision.allowed:
            self.admitted[tenant] = self.admitted.get(tenant, 0) + 1
            return Ticket(tenant, reqs, cost, decision, None, _tail(decision))
        reason = decision.reason or "requests"
        self.refused[(tenant, reason)] = self.refused.get((tenant, reason), 0) + 1
        self.on_refused(tenant, reason)
        extra = b"".join(
            b"%s: %s\r\n" % (n.encode(), v.encode()) for n, v in header_lines(decision)
        )
        error = {
            "message": refusal_message(decision),
            "type": reason,
            "param": None,
            "code": "rate_limit_exceeded",
        }
        refusal = simple_response(
            429,
            orjson.dumps({"error": error}),
            content_type=b"application/json",
            extra=extra + b"x-cache: BYPASS\r\n",
        )
        return Ticket(tenant, 0, 0, decision, refusal, b"")

    def settle(self, ticket: object, status: int | None, body: bytes | None) -> None:
        """Correct a ticket's token charge once the answer is known (fire and forget).

        ``status`` None: the request never got an answer (refused by admission,
        the model server unreachable): its tokens are given back. ``body`` None:
        too large to read the usage from: the estimate stands. An answer without
        ``usage`` keeps the estimate unless it is an error (4xx/5xx: given back).
        """
        assert isinstance(ticket, Ticket)
        if ticket.settled or ticket.refusal is not None or ticket.tokens <= 0:
            return
        ticket.settled = True
        if status is None:
            used = 0
        elif body is None:
            return
        else:
            # a JSON answer is one object; anything else is read as a stream of events
            prompt, completion = usage_of(body, stream=body.lstrip()[:1] != b"{")
            used = prompt + completion
            if used == 0 and status < 400:
                return
        delta = used - ticket.tokens
        if delta == 0:
            return
        limits = self.table.get(ticket.tenant)
        if limits is None:
            return
        if ticket.decision.local or self.client is None:
            self._decide_local(ticket.tenant, limits, 0, delta, force=True)
            return
        self.background.spawn(self._correct(ticket.tenant, limits, delta))

    async def _correct(self, tenant: str, limits: TenantLimits, delta: int) -> None:
        assert self.client is not None
        try:
            await self.client.run_script(
                _SCRIPT,
                [rate_limit_key(self.cache, tenant)],
                _args("force", limits, 0, delta),
                timeout_s=self.timeout_s,
            )
        except resp.RespError as exc:  # the estimate stands: never the client's problem
            self.corrections_failed += 1
            log.debug("rate-limit correction for %s failed: %s", tenant, exc)

    async def _decide(
        self, tenant: str, limits: TenantLimits, mode: str, reqs: int, cost: int
    ) -> Decision:
        client = self.client
        if client is None or time.monotonic() < self._down_until:
            return self._decide_local(tenant, limits, reqs, cost)
        try:
            reply = await client.run_script(
                _SCRIPT,
                [rate_limit_key(self.cache, tenant)],
                _args(mode, limits, reqs, cost),
                timeout_s=self.timeout_s,
            )
            decision = decision_of_reply(reply, limits)
        except Exception as exc:  # any fault of the limiter: this pod decides, never a 5xx
            self._down_until = time.monotonic() + REDIS_RETRY_S
            if not self.redis_error:
                log.warning("rate limits: Redis unreachable, each pod enforces its share: %s", exc)
            self.redis_error = f"{type(exc).__name__}: {exc}"[:200]
            return self._decide_local(tenant, limits, reqs, cost)
        if self.redis_error:
            log.info("rate limits: Redis answers again, limits are fleet-wide")
            self.redis_error = ""
            self._local.clear()
        now = time.monotonic()
        if now - self._members_at >= MEMBERS_REFRESH_S:
            self._members_at = now
            self.background.spawn(self.refresh_members())
        return decision

    def _decide_local(
        self, tenant: str, limits: TenantLimits, reqs: int, cost: int, *, force: bool = False
    ) -> Decision:
        self.local_decisions += 1
        tats = self._local.setdefault(tenant, [0.0, 0.0, 0.0])
        decision, after = decide(
            tats,
            self.clock(),
            limits.share(self.share_of()),
            requests=reqs,
            tokens=cost,
            force=force,
        )
        tats[:] = after
        # without Redis at all this pod is the whole fleet: its decisions are not a fallback
        return dataclasses.replace(decision, local=self.client is not None)

    async def refresh_members(self) -> None:
        """Count the live sidecars of the cache (their heartbeats' unexpired memberships)."""
        assert self.client is not None
        key = members_key(self.cache)
        try:
            n = await self.client.execute(
                "ZCOUNT", key, f"{time.time():.3f}", "+inf", key=key, timeout_s=self.timeout_s
            )
        except resp.RespError as exc:
            log.debug("rate limits: counting members failed: %s", exc)
            return
        self.live_pods = max(1, int(n))

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    # ----------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        """``/status``'s ``rate_limits``: the mode, and each tenant's usage against its limits."""
        local = self.local
        tenants: dict[str, Any] = {}
        for tenant, limits in sorted(self.table.items()):
            last = self.last.get(tenant)
            tenants[tenant] = {
                "limits": limits.to_doc(),
                "usage": {}
                if last is None
                else {
                    b.name: {
                        "limit": b.limit,
                        "remaining": b.remaining,
                        "reset_s": round(b.reset_s, 3),
                        "local": last.local,
                    }
                    for b in last.buckets
                },
                "admitted": self.admitted.get(tenant, 0),
                "refused": {r: n for (t, r), n in self.refused.items() if t == tenant},
            }
        return {
            "mode": "local" if local else "fleet",
            "redis_error": self.redis_error or None,
            "local_share": f"1/{self.share_of()}" if local else None,
            "live_pods": self.live_pods,
            "count_hits": self.count_hits,
            "local_decisions": self.local_decisions,
            "tenants": tenants,
        }

    def families(self) -> Iterator[Metric]:
        """``cachefleet_rate_limit_local``: 1 while this pod enforces its share alone."""
        gauge = GaugeMetricFamily(
            "cachefleet_rate_limit_local",
            "1 while this pod enforces its local share of the tenants' rate limits "
            "(limit / live pods) because Redis cannot be reached.",
            labels=["cache"],
        )
        gauge.add_metric([self.cache], 1.0 if self.table and self.local else 0.0)
        yield gauge


def _parsed(body: bytes) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def _args(mode: str, limits: TenantLimits, reqs: int, tokens: int) -> list[Any]:
    out: list[Any] = [mode]
    for i, (limit, period_ms) in enumerate(zip(limits.limits(), _PERIODS_MS, strict=True)):
        out += [limit, period_ms, reqs if i == 0 else tokens]
    return out
