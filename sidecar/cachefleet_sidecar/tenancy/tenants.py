"""Tenancy: who a request's tenant is, which tenants this pod knows, and the quota table.

:class:`Tenants` owns the tenant rules (:class:`identity.TenantRules`), the
API keys, the operator's quotas, and the tenants' lifetimes on this pod (idle
expiry, replacement of a guest's L1 slot), and where a request stands in
admission (:meth:`Tenants.admission_of`: class, fairness id, weight).
:class:`QuotaApplier` applies the operator's quota table to every part it concerns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cachefleet_common import classes, keys
from cachefleet_common.classes import capped_class
from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_common.contract.names import GUESTS, guest
from cachefleet_sidecar.adapt import flows
from cachefleet_sidecar.adapt.mrc import MissRatioCurves
from cachefleet_sidecar.cache import semantic
from cachefleet_sidecar.cache.entry import L1Value
from cachefleet_sidecar.cache.keying import Keying
from cachefleet_sidecar.cache.l1 import TenantL1
from cachefleet_sidecar.cache.l3 import SemanticTier
from cachefleet_sidecar.cache.switcher import PolicySwitcher
from cachefleet_sidecar.cache.tiers import L2, Freshness
from cachefleet_sidecar.http.server import Request
from cachefleet_sidecar.observe.metrics import SidecarMetrics
from cachefleet_sidecar.tasks import Background
from cachefleet_sidecar.tenancy.identity import (
    ApiKeys,
    TenantRules,
    TrustedNetworks,
    parse_api_keys,
    parse_networks,
)
from cachefleet_sidecar.tenancy.settings import TenancySettings

log = logging.getLogger("cachefleet.sidecar")

#: Tick of the tenant idleness clock, seconds (expiry is counted in ticks of this).
IDLE_TICK_S = 5.0
_OBJECTIVE = classes.OBJECTIVE_HEADER.encode()
_FAIRNESS_ID = classes.FAIRNESS_ID_HEADER.encode()


class Tenants:
    """The tenants of this pod: identity rules, API keys, quotas, lifetimes."""

    def __init__(
        self,
        settings: TenancySettings,
        *,
        l1: TenantL1[int, L1Value],
        l3: SemanticTier,
        mrc: MissRatioCurves | None,
        metrics: SidecarMetrics,
        switcher: PolicySwitcher,
        l2_usage: dict[str, tuple[int, int]],
    ) -> None:
        self.settings = settings
        self.l1 = l1
        self.l3 = l3
        self.mrc = mrc
        self.metrics = metrics
        self.switcher = switcher
        #: (bytes, limit) per tenant in L2, for /metrics and /status (kept by the admin).
        self.l2_usage = l2_usage
        self.api_keys: ApiKeys | None = None
        if settings.api_keys_file:
            self.api_keys = ApiKeys.from_file(settings.api_keys_file)
        elif settings.api_keys:
            self.api_keys = ApiKeys(parse_api_keys(settings.api_keys))
        #: Who the tenant of a request is (its tables follow the keys file and the quotas).
        self.rules = TenantRules(
            settings.tenant_header,
            api_keys=self.api_keys,
            trusted=TrustedNetworks(parse_networks(settings.trusted_proxies)),
            default_tenant=settings.default_tenant,
            known=settings.tenants,
            admit_guests=settings.guest_share > 0,
            on_mismatch=metrics.identity_mismatch,
        )
        self.resolve = self.rules.resolve
        self.quota_generation = -1
        self.quotas: dict[str, TenantQuota] = {}
        #: The operator's ``tenantDefaults`` (None: unlisted tenants are not admitted as such).
        self.default_quota: TenantQuota | None = None
        #: GIE objective name -> class (the flag's, then the operator's table over it).
        self.objectives: dict[str, str] = dict(settings.admission_objectives)
        self.update_reserved()

    def resolve_tenant(self, request: Request) -> str:
        """The request's tenant (:class:`identity.TenantRules`); :class:`Refusal` otherwise."""
        return self.rules.resolve(request.headers, request.peer)

    @property
    def known(self) -> set[str]:
        """Tenants admitted by name (configured and the operator's); empty: any valid name."""
        return self.rules.known

    def named(self) -> set[str]:
        """Every tenant this pod knows by name: known, keyed, and the default."""
        tenants = set(self.known)
        if self.api_keys is not None:
            tenants |= self.api_keys.tenants
        if self.settings.default_tenant is not None:
            tenants.add(self.settings.default_tenant)
        return tenants

    def priority_class(self, tenant: str) -> str | None:
        """The admission priority class of ``tenant``'s quota (None: none said)."""
        quota = self.quotas.get(tenant) or self.default_quota
        return None if quota is None else quota.priority_class

    def admission_of(
        self, tenant: str, headers: list[tuple[bytes, bytes]]
    ) -> tuple[str | None, flows.Flow]:
        """A request's admission class and flow (docs/admission.md, "GIE's headers").

        The class is the tenant's, lowered (never raised) by every
        ``x-gateway-inference-objective`` the table knows; the flow is the tenant,
        weighted by its quota's ``fairness_weight`` (else the flag's, else 1), and its
        ``x-gateway-inference-fairness-id`` when exactly one value is given. Neither
        header needs a trusted peer: each can only lower its own request or divide its
        own tenant's share.
        """
        quota = self.quotas.get(tenant) or self.default_quota
        cls: str | None = None if quota is None else quota.priority_class
        weight = None if quota is None else quota.fairness_weight
        if weight is None:
            weight = self.settings.admission_weights.get(tenant, flows.DEFAULT_WEIGHT)
        fairness: set[str] = set()
        for name, value in headers:
            if name == _OBJECTIVE:  # every one, and every comma-separated value, may lower
                for part in value.decode("latin-1").split(","):
                    cls = capped_class(cls, self.objectives.get(part.strip()))
            elif name == _FAIRNESS_ID:
                fairness.add(flows.fairness_id(value))
        fid = fairness.pop() if len(fairness) == 1 else ""
        return cls, flows.Flow(tenant, fid, weight)

    def l2_allowed(self, tenant: str) -> bool:
        """Whether ``tenant`` reads and writes Redis.

        Guests of ``tenantDefaults`` do, in the guests' pool, while the operator
        gives the pool bytes (:meth:`l2_name`); guests of ``--guest-share``
        alone stay in L1.
        """
        return (
            (self.settings.guest_share <= 0 and self.default_quota is None)
            or not self.l1.is_guest(tenant)
            or not (self.l1.reserved or self.quotas or self.default_quota)
            or self.guests_in_l2
        )

    @property
    def guests_in_l2(self) -> bool:
        """True while the operator gives the unlisted tenants an L2 pool."""
        quota = self.default_quota
        return quota is not None and quota.l2_bytes > 0

    def l2_name(self, tenant: str) -> str:
        """``tenant``'s name in L2 keys: a guest's scope in the guests' pool, or its own."""
        if self.guests_in_l2 and self.l1.is_guest(tenant):
            return guest(tenant)
        return tenant

    def poll_api_keys(self) -> bool:
        """Re-read the API-keys file if it changed (called periodically by the server)."""
        if self.api_keys is None or not self.api_keys.poll():
            return False
        self.changed()
        return True

    def changed(self) -> None:
        """Known/reserved tenants moved: forget memoised tenant decisions."""
        self.rules.memo.clear()
        self.update_reserved()

    def update_reserved(self) -> None:
        """Known tenants (configured, keyed, with quotas, the default) keep shares and series."""
        reserved = self.named()
        self.l1.set_reserved(reserved)
        self.metrics.set_reserved(reserved)
        if self.mrc is not None:
            self.mrc.limit_to(frozenset(reserved) if reserved else None)

    def expire_idle(self, max_idle_ticks: int) -> list[str]:
        """One tick of the idleness clock: drop tenants idle for longer (L1, series, L2 gauges).

        Called every :data:`IDLE_TICK_S` by the server; returns the tenants whose
        L1 partition expired.
        """
        self.l1.advance()
        gone = self.l1.expire_idle(max_idle_ticks)
        for tenant in self.metrics.expire_idle(max_idle_ticks):
            self.l2_usage.pop(tenant, None)
        for tenant in gone:
            self.metrics.forget(tenant)
            self.metrics.forget_policy_switches(tenant)
            self.l2_usage.pop(tenant, None)
            self.l3.forget(tenant)
            if self.mrc is not None:
                self.mrc.forget(tenant)
        if gone:
            log.info("%d idle tenants expired from L1", len(gone))
        self.switcher.kick_migration()
        return gone

    def replaced(self, tenant: str) -> None:
        """A newcomer took ``tenant``'s L1 slot: drop what this pod keeps for it.

        Its metric series stay until they idle out (bounded, ``_other`` beyond
        the bound), so a busy pod does not churn a new label value per newcomer.
        """
        self.l2_usage.pop(tenant, None)
        self.l3.forget(tenant)
        if self.mrc is not None:
            self.mrc.forget(tenant)
        self.switcher.forget(tenant)


class QuotaApplier:
    """Applies the operator's quota table (from the control sync) to every part it moves."""

    def __init__(
        self,
        settings: TenancySettings,
        *,
        tenants: Tenants,
        keying: Keying,
        freshness: Freshness,
        l1: TenantL1[int, L1Value],
        l2: L2 | None,
        l3: SemanticTier,
        mrc: MissRatioCurves | None,
        switcher: PolicySwitcher,
        background: Background,
    ) -> None:
        self.settings = settings
        self.tenants = tenants
        self.keying = keying
        self.freshness = freshness
        self.l1 = l1
        self.l2 = l2
        self.l3 = l3
        self.mrc = mrc
        self.switcher = switcher
        self.background = background
        #: Parts told of each newer table too (the rate limits).
        self.listeners: list[Callable[[QuotaAssignment], None]] = []

    def apply(self, assignment: QuotaAssignment) -> None:
        """Apply the operator's quota table (idempotent; older generations ignored)."""
        tenants = self.tenants
        if assignment.generation <= tenants.quota_generation:
            return
        for listener in self.listeners:
            listener(assignment)
        tenants.quota_generation = assignment.generation
        tenants.quotas = dict(assignment.tenants)
        tenants.default_quota = assignment.default_tenant
        tenants.objectives = {**self.settings.admission_objectives, **assignment.objectives}
        tenants.rules.set_known(
            set(self.settings.tenants) | set(assignment.tenants),
            admit_guests=self.settings.guest_share > 0 or tenants.default_quota is not None,
        )
        tenants.changed()
        base = self.keying.default_options
        self.keying.set_key_options(
            {
                t: keys.KeyOptions(
                    collapse_whitespace=base.collapse_whitespace
                    if q.collapse_whitespace is None
                    else q.collapse_whitespace,
                    cache_nondeterministic=base.cache_nondeterministic
                    if q.cache_nondeterministic is None
                    else q.cache_nondeterministic,
                )
                for t, q in assignment.tenants.items()
            }
        )
        self.freshness.apply(assignment, self.l1)
        usable = self.switcher.usable_policy
        if assignment.tenants:
            policies = {
                t: usable(q.policy or assignment.default_policy)
                for t, q in assignment.tenants.items()
            }
            self.l1.set_quotas(
                {t: (q.l1_bytes, policies[t]) for t, q in assignment.tenants.items()}
            )
            if self.mrc is not None:
                for tenant, policy in policies.items():
                    self.mrc.set_policy(tenant, policy)
        else:
            self.l1.set_quotas(None)
        unlisted = assignment.default_tenant
        if unlisted is None:
            self.l1.set_guest_pool(None)
        else:
            policy = usable(unlisted.policy or assignment.default_policy)
            self.l1.set_guest_pool(unlisted.l1_bytes, policy)
        self.switcher.kick_migration()
        if self.l2 is not None:
            for tenant, quota in assignment.tenants.items():
                self.background.spawn(self.l2.set_limit(tenant, quota.l2_bytes))
            if tenants.guests_in_l2:
                assert unlisted is not None
                self.background.spawn(
                    self.l2.set_limit(
                        GUESTS, unlisted.l2_bytes, guest_max_share=unlisted.l2_guest_max_share
                    )
                )
        default = self.l3.default
        self.l3.set_options(
            {
                t: semantic.SemanticOptions(
                    enabled=default.enabled if q.semantic is None else q.semantic,
                    threshold=q.semantic_threshold or default.threshold,
                    max_bytes=default.max_bytes,
                    shadow=default.shadow if q.semantic_shadow is None else q.semantic_shadow,
                )
                for t, q in assignment.tenants.items()
            }
        )
        log.info(
            "applied quotas generation %d for %d tenants",
            assignment.generation,
            len(assignment.tenants),
        )
