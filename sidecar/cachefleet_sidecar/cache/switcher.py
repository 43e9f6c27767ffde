"""Adapting L1 policies: the switching engine's observations and ticks, policy migration.

:class:`PolicySwitcher` feeds the P99-driven :class:`switching.SwitchingEngine`
(when on) with each cacheable request, applies its decisions to L1 (the new
policy serves at once; entries move over in bounded background batches), and
says which policy this sidecar can run for one the operator asks for.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from cachefleet_common.contract.names import Policy
from cachefleet_sidecar.adapt.host import HostPressure
from cachefleet_sidecar.adapt.mrc import MissRatioCurves
from cachefleet_sidecar.adapt.switching import SwitchingEngine, gpu_pressure
from cachefleet_sidecar.adapt.telemetry import GpuTelemetry
from cachefleet_sidecar.cache.entry import L1Value
from cachefleet_sidecar.cache.l1 import TenantL1
from cachefleet_sidecar.observe.metrics import SidecarMetrics
from cachefleet_sidecar.policies import available_policies
from cachefleet_sidecar.tasks import Background

log = logging.getLogger("cachefleet.sidecar")

#: Entries a policy switch moves per batch between requests (small: a batch runs between
#: requests on the event loop, so it must not stall them).
MIGRATION_BATCH = 256
#: Pause between two migration batches, seconds (requests run in between).
MIGRATION_PAUSE_S = 0.002


class PolicySwitcher:
    """Switches L1 policies per tenant (with an engine) and drains switched partitions."""

    def __init__(
        self,
        *,
        engine: SwitchingEngine | None,
        l1: TenantL1[int, L1Value],
        mrc: MissRatioCurves | None,
        metrics: SidecarMetrics,
        telemetry: GpuTelemetry,
        host: HostPressure,
        background: Background,
    ) -> None:
        #: The P99-driven policy switching engine (None when switched off).
        self.engine = engine
        self.l1 = l1
        self.mrc = mrc
        self.metrics = metrics
        self.telemetry = telemetry
        self.host = host
        self.background = background
        self._migration: asyncio.Task[None] | None = None

    def observe(self, tenant: str, seconds: float, digest: int) -> None:
        """Feed the switching engine; close its windows when one has ended."""
        engine = self.engine
        assert engine is not None
        engine.observe(tenant, seconds, digest)
        self.switch_due()

    def switch_due(self) -> None:
        """Close the switching engine's windows when one has ended (after observations)."""
        engine = self.engine
        assert engine is not None
        now = time.monotonic()
        if now >= engine.next_window_at:
            try:
                self.switch_tick(now)
            except Exception:  # never the request's problem: counted, logged
                self.metrics.fault("policy_switching")
                log.exception("policy switching failed; the L1 keeps its policies")

    def switch_tick(self, now: float) -> None:
        """Apply GPU pressure, close ended windows and apply their decisions."""
        engine = self.engine
        if engine is None:
            return
        pressure = gpu_pressure(self.telemetry.samples())
        engine.set_pressure(pressure)
        engine.set_host_pressure(self.host.sample().pressure)
        self.l1.set_pressure(pressure)
        policies = {t: s.policy for t, s in self.l1.stats().items()}
        for tenant, policy in policies.items():
            if policy != engine.config.target:
                self.metrics.expect_policy_switches(tenant, policy, engine.config.target)
        for d in engine.tick(now, policies):
            # O(1): the new policy serves at once, the entries move over in the
            # background (kick_migration) and on touch; no request sees a gap.
            self.l1.set_policy(d.tenant, d.to_policy if d.action == "switch" else None)
            if self.mrc is not None:  # the curve follows the policy in force
                self.mrc.set_policy(d.tenant, self.l1.stats()[d.tenant].policy)
            self.metrics.policy_switch(d.tenant, d.from_policy, d.to_policy)
            log.info("policy %s %s", d.action, orjson.dumps(d.as_dict()).decode())
        self.kick_migration()

    def forget(self, tenant: str) -> None:
        """``tenant`` left this pod: its switching state goes too."""
        self.metrics.forget_policy_switches(tenant)
        if self.engine is not None:
            self.engine.forget(tenant)

    def kick_migration(self) -> None:
        """Drain switched partitions in the background, if any (no-op without a running loop)."""
        if not self.l1.migrating or (self._migration is not None and not self._migration.done()):
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # nothing to run it on: touches still move entries; the next kick drains
        self._migration = self.background.spawn(self._drain_migrations())

    async def _drain_migrations(self) -> None:
        """Move switched partitions' entries in bounded batches, yielding in between."""
        while self.l1.migrating:
            self.l1.migrate_step(MIGRATION_BATCH)
            await asyncio.sleep(MIGRATION_PAUSE_S)

    def usable_policy(self, wanted: Policy) -> str:
        """``wanted`` if this sidecar implements it, else LIRS (logged, counted)."""
        if wanted.value in available_policies():
            return wanted.value
        log.warning("policy %r is not available in this sidecar; using lirs", wanted.value)
        self.metrics.fault("policy_unavailable")
        return Policy.LIRS.value
