"""The tenancy room's settings: who a request's tenant is, guests, classes, rate limits.

The sidecar's command line (the top floor) fills this record; the room's code
reads it, never the whole sidecar configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachefleet_common.limits import TenantLimits

DEFAULT_TENANT_HEADER = "X-Tenant-ID"
DEFAULT_MAX_TENANTS = 64
DEFAULT_TENANT_IDLE_EXPIRY_S = 600.0


@dataclass(frozen=True, slots=True)
class TenancySettings:
    """Identity, the known tenants and guests, admission classes, and rate limits."""

    tenant_header: str = DEFAULT_TENANT_HEADER
    default_tenant: str | None = None
    tenants: tuple[str, ...] = ()
    #: API key (or ``sha256:<hex>`` digest) -> tenant, given directly (tests, embedding).
    api_keys: dict[str, str] = field(default_factory=dict)
    #: JSON file of the same, re-read when it changes (a mounted Secret).
    api_keys_file: str | None = None
    #: CIDRs whose tenant header is believed; empty: the header is never believed.
    trusted_proxies: tuple[str, ...] = ()
    #: Share of L1 for tenants that are not known (0: they are sized like everyone else).
    guest_share: float = 0.0
    #: Most tenant partitions in L1, and most tenants with their own metric series.
    max_tenants: int = DEFAULT_MAX_TENANTS
    #: Seconds without a request after which a tenant's L1 partition and series go (0: never).
    tenant_idle_expiry_s: float = DEFAULT_TENANT_IDLE_EXPIRY_S
    #: Fairness weight per tenant in the Standard queue (the operator's table wins).
    admission_weights: dict[str, float] = field(default_factory=dict)
    #: GIE objective name -> the class it lowers a request to (the operator's table adds).
    admission_objectives: dict[str, str] = field(default_factory=dict)
    #: Request and token limits by tenant (--tenant-limits; the operator's win for its tenants).
    tenant_limits: dict[str, TenantLimits] = field(default_factory=dict)
    #: Cache hits of a rate-limited tenant count as requests (never as tokens).
    limits_count_hits: bool = False
