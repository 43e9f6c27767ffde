"""The admission gate's I/O: reads the model server's ``/metrics``, parks waiting misses.

The decisions are :mod:`cachefleet_sidecar.adapt.admission`'s (pure); this adapter
feeds it a reading every :data:`METRICS_POLL_S` (parsed by
:func:`modelserver.parse_metrics`; a reading that fails, takes longer than
:data:`METRICS_TIMEOUT_S` in all, is larger than :data:`MAX_METRICS_BYTES` or
names no model server counts as "not saturated" and is counted; the poller
outlives any answer), turns parked Standard requests into futures the request
waits on (each up to its own maximum wait, readings or not; released in the
core's weighted fair order between tenants), and renders refusals (429 / 503
with ``Retry-After`` and a JSON body that gives the reason). The sidecar asks
it for every request about to go upstream (it counts them until a reading can
show them): a cache hit never meets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from cachefleet_common.classes import normal_class
from cachefleet_common.contract.urls import redact_url
from cachefleet_common.modelserver import (
    MetricsParseError,
    ModelServerMetrics,
    parse_metrics,
)
from cachefleet_sidecar.adapt.admission import ADMIT, Admission, AdmissionConfig, Decision
from cachefleet_sidecar.adapt.flows import Flow
from cachefleet_sidecar.http.server import error_response

log = logging.getLogger("cachefleet.admission")

#: How often the model server's /metrics is read, seconds.
METRICS_POLL_S = 0.5
#: How long one reading may take in all (connect, headers, body) before it counts as a
#: fault, seconds.
METRICS_TIMEOUT_S = 1.0
#: Largest /metrics answer read (a model server's is tens of kB).
MAX_METRICS_BYTES = 4 * 1024 * 1024

#: Called with (tenant, class, reason) for every refusal.
RefusalCounter = Callable[[str, str, str], None]
#: A request's class and flow from its tenant and (lowercased) headers
#: (:meth:`cachefleet_sidecar.tenancy.tenants.Tenants.admission_of`).
FlowOf = Callable[[str, list[tuple[bytes, bytes]]], tuple[str | None, Flow]]


def refusal_response(decision: Decision) -> bytes:
    """The answer of a refused request: its status, ``Retry-After`` and a JSON error."""
    return error_response(
        decision.status,
        decision.message,
        "cachefleet_admission",
        extra=b"retry-after: %d\r\nx-cache: BYPASS\r\n" % decision.retry_after_s,
        reason=decision.reason,
        retry_after_s=decision.retry_after_s,
    )


class AdmissionGate:
    """One sidecar's admission: the core, its metrics poller and its parked requests."""

    def __init__(
        self,
        config: AdmissionConfig,
        metrics_url: str,
        *,
        on_refusal: RefusalCounter | None = None,
        on_wait: Callable[[str], None] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        poll_s: float = METRICS_POLL_S,
        read_timeout_s: float = METRICS_TIMEOUT_S,
    ) -> None:
        self.core = Admission(config)
        self.metrics_url = metrics_url
        self.poll_s = poll_s
        self.read_timeout_s = read_timeout_s
        #: Readings taken (failed ones included).
        self.polls = 0
        self._on_refusal = on_refusal
        self._on_wait = on_wait
        self._transport = transport
        #: Class and flow of a request from its headers (None: the tenant's class, own flow).
        self.flow_of: FlowOf | None = None
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def shedding(self) -> bool:
        return self.core.shedding_since is not None

    @property
    def busy(self) -> bool:
        """True: every request about to go upstream must ask :meth:`admit` (the fast path
        steps aside), because the core counts what was sent since its last reading."""
        return True

    # ---------------------------------------------------------------- poller
    def start(self) -> None:
        """Start polling (needs a running loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # never: poll_once takes any answer; the poller must not die
                log.exception("admission poll failed")
            await asyncio.sleep(self.poll_s)

    async def read_metrics(self) -> ModelServerMetrics | None:
        """One reading of the model server (None when it failed).

        Bounded in time as a whole (:data:`METRICS_TIMEOUT_S`, however slowly the
        answer trickles in) and in size (:data:`MAX_METRICS_BYTES`, read as it
        streams in: a larger answer is a failed reading, the rest is never read).
        """
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=METRICS_TIMEOUT_S, transport=self._transport, follow_redirects=False
            )
        try:
            async with asyncio.timeout(self.read_timeout_s):
                body = await self._read_body(self._client)
            return parse_metrics(body.decode("utf-8"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any answer, or none in time, is a failed reading
            log.debug("model server metrics unreadable: %s", str(exc) or type(exc).__name__)
            return None

    async def _read_body(self, client: httpx.AsyncClient) -> bytes:
        """The answer's body, as sent (identity), up to :data:`MAX_METRICS_BYTES`."""
        headers = {"accept-encoding": "identity"}
        async with client.stream("GET", self.metrics_url, headers=headers) as resp:
            resp.raise_for_status()
            encoding = resp.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):  # its expanded size is unknown: not read
                raise MetricsParseError(f"answer encoded as {encoding!r}")
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_METRICS_BYTES:
                raise MetricsParseError(f"answer of {declared} bytes")
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.aiter_raw():
                size += len(chunk)
                if size > MAX_METRICS_BYTES:
                    raise MetricsParseError(f"answer over {MAX_METRICS_BYTES} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

    async def poll_once(self) -> None:
        """Read once, update the core, let parked requests go or time them out."""
        reading = await self.read_metrics()
        self.polls += 1
        now = time.monotonic()
        core = self.core
        try:
            changed = core.observe(reading, now)
        except Exception:  # a reading the core cannot take is a failed reading
            log.exception("admission could not take a reading")
            changed = core.observe(None, now)
        if changed:
            if self.shedding:
                log.warning(
                    "shedding started: model server saturated (%s; waiting %g, KV %.0f%%)",
                    core.cause,
                    core.waiting,
                    core.kv_usage * 100,
                )
            else:
                log.info("shedding stopped: the model server has room again")
        for ticket in core.release():
            self._settle(ticket, ADMIT)
        expired = core.expire(now)
        if expired:
            decision = core.timeout_decision()
            for ticket in expired:
                self._settle(ticket, decision)

    @staticmethod
    def _settle(ticket: object, decision: Decision) -> None:
        if isinstance(ticket, asyncio.Future) and not ticket.done():
            ticket.set_result(decision)

    # ---------------------------------------------------------------- requests
    async def admit(
        self,
        tenant: str,
        priority_class: str | None,
        flow: Flow | None = None,
        *,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> bytes | None:
        """None when the request may go upstream; else the refusal to answer with.

        ``flow``: where it waits if it must (None: the tenant's own flow, weight 1).
        ``headers``: the request's, read by :attr:`flow_of` (when set) for its class and
        flow instead (GIE's objective and fairness id).
        """
        if headers is not None and self.flow_of is not None:
            priority_class, flow = self.flow_of(tenant, headers)
        core = self.core
        ticket: asyncio.Future[Decision] | None = None
        if core.saturated or core.queued:
            ticket = asyncio.get_running_loop().create_future()
        decision = core.decide(priority_class, time.monotonic(), ticket, flow=flow or Flow(tenant))
        evicted = core.take_evicted()
        if evicted:  # they gave their place up to this one: their answer is the 429
            full = core.full_decision()
            for other in evicted:
                self._settle(other, full)
        if decision.action == "wait":
            assert ticket is not None
            if self._on_wait is not None:
                self._on_wait(tenant)
            decision = await self._wait(ticket)
        if decision.action == "admit":
            return None
        if self._on_refusal is not None:
            self._on_refusal(tenant, normal_class(priority_class), decision.reason)
        return refusal_response(decision)

    async def _wait(self, ticket: asyncio.Future[Decision]) -> Decision:
        """A parked request's answer: what a reading decides, or, once its own maximum wait
        has passed without one (readings stalled or still saturated), the timeout's."""
        core = self.core
        try:
            return await asyncio.wait_for(asyncio.shield(ticket), core.config.standard_max_wait_s)
        except TimeoutError:
            if ticket.done():  # a reading settled it as the wait ran out
                return ticket.result()
            core.abandon(ticket)
            ticket.cancel()
            return core.timeout_decision()
        except asyncio.CancelledError:
            core.abandon(ticket)
            raise

    def describe(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "metrics_url": redact_url(self.metrics_url),
            **self.core.describe(),
        }

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for ticket in self.core.release_all():
            self._settle(ticket, ADMIT)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
