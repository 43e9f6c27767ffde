"""Telemetry and admin: /healthz, /readyz, /status, /metrics, the heartbeat, savings.

:class:`Admin` reads every part's state at request (or scrape) time from its
owner; it changes nothing. :class:`AdminHandler` serves the admin endpoints on
their own port (``--admin-listen``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson

from cachefleet_common import prices
from cachefleet_common.contract.messages import Heartbeat
from cachefleet_common.contract.names import GUESTS, Policy
from cachefleet_common.contract.urls import redact_url
from cachefleet_sidecar.adapt.host import HostPressure
from cachefleet_sidecar.adapt.switching import SwitchingEngine
from cachefleet_sidecar.adapt.telemetry import GpuTelemetry
from cachefleet_sidecar.cache.entry import L1Value
from cachefleet_sidecar.cache.keying import Keying
from cachefleet_sidecar.cache.l1 import TenantL1
from cachefleet_sidecar.cache.l3 import SemanticTier
from cachefleet_sidecar.cache.tiers import L2
from cachefleet_sidecar.config import SidecarConfig
from cachefleet_sidecar.control.upkeep import Upkeep
from cachefleet_sidecar.http.gate import AdmissionGate
from cachefleet_sidecar.http.relay import Relay
from cachefleet_sidecar.http.server import Connection, Request, simple_response
from cachefleet_sidecar.observe.metrics import GuestPool, SidecarMetrics, TierUsage
from cachefleet_sidecar.tenancy.identity import TrustedNetworks, parse_networks
from cachefleet_sidecar.tenancy.tenants import Tenants

#: How often the L2 bytes of each tenant are read for /metrics and /status, seconds.
L2_USAGE_REFRESH_S = 10.0


class Admin:
    """What the admin endpoints and the control heartbeat say about this sidecar."""

    def __init__(
        self,
        config: SidecarConfig,
        *,
        l1: TenantL1[int, L1Value],
        l2: L2 | None,
        l3: SemanticTier,
        keying: Keying,
        tenants: Tenants,
        upkeep: Upkeep,
        relay: Relay,
        metrics: SidecarMetrics,
        telemetry: GpuTelemetry,
        gate: AdmissionGate | None,
        switching: SwitchingEngine | None,
        host: HostPressure,
        l2_usage: dict[str, tuple[int, int]],
    ) -> None:
        self.config = config
        self.l1 = l1
        self.l2 = l2
        self.l3 = l3
        self.keying = keying
        self.tracker = keying.tracker
        self.tenants = tenants
        self.upkeep = upkeep
        self.relay = relay
        self.metrics = metrics
        self.telemetry = telemetry
        self.gate = gate
        self.switching = switching
        self.host = host
        #: (bytes, limit) per tenant in L2, refreshed in the background by the server.
        self.l2_usage = l2_usage
        #: Peers shown tenant names in /status (loopback's 127.0.0.1 and ::1 by default).
        self.status_peers = TrustedNetworks(parse_networks(config.observe.status_peers))
        #: Prices per 1k tokens by model (--price-table): /status says whether savings are priced.
        self.prices = config.caching.price_table
        self.started_at = time.time()
        #: The rate limits' /status section (None: no limiter).
        self.rate_limits: Callable[[], dict[str, Any]] | None = None

    def heartbeat(self) -> Heartbeat:
        # unlisted tenants counted apart only while they are admitted (not in open mode)
        admitting = self._admits_guests()
        listed: dict[str, Policy] = {}
        unlisted: dict[Policy, int] = {}
        for tenant, stats in self.l1.stats().items():
            policy = Policy(stats.policy)
            if admitting and self.l1.is_guest(tenant):
                unlisted[policy] = unlisted.get(policy, 0) + 1
            else:
                listed[tenant] = policy
        return Heartbeat(
            pod=self.config.pod,
            quota_generation=self.tenants.quota_generation,
            policy_by_tenant=listed,
            unlisted_by_policy=unlisted,
            redis_ok=self.l2 is None or self.l2.state == "ok",
            shedding=self.gate is not None and self.gate.shedding,
        )

    def usage(self) -> list[TierUsage]:
        """Bytes and limits of each tenant in L1 and L2 (the metrics' usage source)."""
        out = [
            TierUsage(t, "l1", s.used_bytes, s.capacity_bytes, s.policy)
            for t, s in self.l1.stats().items()
        ]
        out += [
            TierUsage(t, "l2", used, limit)
            for t, (used, limit) in self.l2_usage.items()
            if t != GUESTS
        ]
        return out

    def guest_pool(self) -> GuestPool | None:
        """The unlisted tenants on this pod and their L2 pool (None: none are admitted)."""
        if not self._admits_guests():
            return None
        guests = sum(1 for t in self.l1.stats() if self.l1.is_guest(t))
        return GuestPool(guests=guests, l2=self.l2_usage.get(GUESTS))

    def _admits_guests(self) -> bool:
        """Unlisted tenants are admitted (tenantDefaults or --guest-share), not refused."""
        return self.tenants.default_quota is not None or self.config.tenancy.guest_share > 0

    async def refresh_l2_usage(self) -> None:
        """Read each tenant's L2 bytes and limit (for /metrics and /status)."""
        if self.l2 is None:
            return
        tenants = self.tenants
        for tenant in set(tenants.quotas) | set(self.l1.stats()):
            if tenants.l2_name(tenant) != tenant:
                continue  # a guest: its bytes count in the pool
            used, limit = await self.l2.usage(tenant)
            if limit:
                self.l2_usage[tenant] = (used, limit)
        if tenants.guests_in_l2:
            self.l2_usage[GUESTS] = await self.l2.usage(GUESTS)
        else:
            self.l2_usage.pop(GUESTS, None)

    def status(self) -> dict[str, Any]:
        self.metrics.flush()  # the hits' batched bookkeeping counts before it is shown
        stats = self.l1.stats()
        quotas = self.tenants.quotas
        return {
            "cache": self.config.cache,
            "pod": self.config.pod,
            "upstream": redact_url(self.config.http.upstream),
            "uptime_s": round(time.time() - self.started_at, 3),
            "quota_generation": self.tenants.quota_generation,
            "model_version": self.keying.model_version,
            "invalidation_epochs": self.tracker.known,
            "warmup": self.upkeep.warm.describe(),
            "purges": dict(self.upkeep.purge_stats),
            "epochs_confirmed": self.tracker.valid_until > time.monotonic(),
            "redis_outage": self.outage_mode(),
            "l1": {
                "capacity_bytes": self.config.caching.l1_bytes,
                "default_policy": self.config.caching.policy.value,
            },
            "tenants": {
                t: {
                    "policy": s.policy,
                    "l1_bytes": s.used_bytes,
                    "l1_quota_bytes": s.capacity_bytes,
                    "l1_entries": s.entries,
                    "l1_evictions": s.evictions,
                    "l1_migrating_entries": s.migrating,
                    "l2_quota_bytes": quotas[t].l2_bytes if t in quotas else None,
                    "l2_bytes": self.l2_usage[t][0] if t in self.l2_usage else None,
                }
                for t, s in stats.items()
            },
            "known_tenants": sorted(self.tenants.known),
            "l2_guests": None
            if GUESTS not in self.l2_usage
            else dict(zip(("bytes", "limit_bytes"), self.l2_usage[GUESTS], strict=True)),
            "savings": self.savings(),
            "saved": self.saved_totals(),
            "redis": None if self.l2 is None else self.l2.state,
            "gpu_telemetry": self.telemetry.describe(),
            "semantic": self.l3.describe(),
            "admission": {"enabled": False} if self.gate is None else self.gate.describe(),
            "rate_limits": None if self.rate_limits is None else self.rate_limits(),
            "policy_switching": {"enabled": False}
            if self.switching is None
            else {"enabled": True, **self.switching.status(), "host": self.host.describe()},
            "degraded": {
                "redis": self.l2 is not None and self.l2.state != "ok",
                "gpu_telemetry": not self.telemetry.available,
            },
        }

    def savings(self) -> dict[str, dict[str, dict[str, float | int]]]:
        """Per tenant and model: what cache hits saved the model since the sidecar started."""
        return {
            t: {model: saved.as_dict() for model, saved in tm.saved.items()}
            for t, tm in self.metrics.tenants.items()
            if tm.saved
        }

    def saved_totals(self) -> dict[str, float | int]:
        """:meth:`savings` added over tenants and models (shown to every peer)."""
        total = prices.Saved()
        for tm in self.metrics.tenants.values():
            for saved in tm.saved.values():
                total.hits += saved.hits
                total.prompt_tokens += saved.prompt_tokens
                total.completion_tokens += saved.completion_tokens
                total.model_seconds += saved.model_seconds
                total.cost += saved.cost
        return {**total.as_dict(), "priced": bool(self.prices)}

    def outage_mode(self) -> dict[str, Any]:
        """What this sidecar does while Redis is unreachable (the InferenceCache's choice)."""
        bound = self.config.control.redis_outage_staleness_s
        if bound > 0:
            return {
                "mode": "serve-stale",
                "max_staleness_s": self.tracker.bound_s,
                "says": f"L1 hits go on for up to {self.tracker.bound_s:g} s after the last "
                "confirmed epochs; requests that miss L1 go upstream",
            }
        return {
            "mode": "strict",
            "max_staleness_s": self.tracker.bound_s,
            "says": "L1 hits stop once the epochs cannot be confirmed; requests go upstream",
        }

    async def ready(self) -> bool:
        if self.upkeep.warm.state == "running":
            return False  # filling L1 from L2 (bounded by --warm-timeout)
        return await self.relay.ready()

    async def handle(self, request: Request, conn: Connection) -> None:
        path = request.url.split(b"?", 1)[0]
        if path == b"/healthz":
            conn.write(simple_response(200, b"ok\n"))
        elif path == b"/readyz":
            ok = await self.ready()
            conn.write(
                simple_response(200, b"ready\n")
                if ok
                else simple_response(
                    503,
                    b"warming L1 from L2\n"
                    if self.upkeep.warm.state == "running"
                    else b"upstream unreachable\n",
                )
            )
        elif path == b"/status":
            status = self.status()
            if not self.status_peers.trusts(request.peer):
                status = public_status(status)
            conn.write(
                simple_response(
                    200,
                    orjson.dumps(status, option=orjson.OPT_INDENT_2),
                    content_type=b"application/json",
                )
            )
        elif path == b"/metrics":
            # Piece by piece, giving the loop back in between: hits are not held up by a scrape.
            pieces: list[bytes] = []
            for piece in self.metrics.exposition():
                pieces.append(piece)
                await asyncio.sleep(0)
            conn.write(
                simple_response(200, b"".join(pieces), content_type=b"text/plain; version=0.0.4")
            )
        else:
            conn.write(simple_response(404, b"not found\n"))


#: /status fields that name tenants: shown only to --status-peers (loopback: kubectl
#: port-forward, exec; 127.0.0.6, where Istio delivers mesh traffic, is not among them).
TENANT_FIELDS = (
    "tenants",
    "known_tenants",
    "invalidation_epochs",
    "policy_switching",
    "savings",
    "rate_limits",
)


def public_status(status: dict[str, Any]) -> dict[str, Any]:
    """/status for a peer outside --status-peers: tenant names replaced by counts."""
    out = {k: v for k, v in status.items() if k not in TENANT_FIELDS}
    out["tenant_count"] = len(status.get("tenants") or {})
    out["policy_switching_enabled"] = bool((status.get("policy_switching") or {}).get("enabled"))
    out["tenants_hidden"] = (
        "tenant details are shown to 127.0.0.1 and ::1 only (kubectl port-forward), "
        "or to --status-peers"
    )
    return out


class AdminHandler:
    """Handler for the admin port: only the admin endpoints."""

    def __init__(self, admin: Admin) -> None:
        self.admin = admin

    def fast(self, request: Request) -> bytes | None:
        return None

    def resume(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        return None

    async def handle(self, request: Request, conn: Connection) -> None:
        await self.admin.handle(request, conn)
