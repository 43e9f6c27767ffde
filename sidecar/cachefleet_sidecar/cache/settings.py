"""The cache room's settings: L1, L2, entries, keying and the semantic tier (L3).

The sidecar's command line (the top floor) fills these records; the room's
code reads them, never the whole sidecar configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachefleet_common.contract.names import Policy
from cachefleet_sidecar.cache.semantic import DEFAULT_TENANT_BYTES, DEFAULT_THRESHOLD

DEFAULT_L1_BYTES = 256 * 1024 * 1024
DEFAULT_L2_TTL_S = 3600.0
#: Largest answer stored in L1 / in L2 (larger ones are passed through, not stored).
DEFAULT_MAX_ENTRY_BYTES = 8 * 1024 * 1024
DEFAULT_L2_MAX_ENTRY_BYTES = 1024 * 1024
DEFAULT_NAMESPACE_HEADER = "X-Cache-Namespace"
#: Seconds one embedding may take before the lookup is given up (a miss); the default of
#: ``--semantic-timeout``. Every L3 request that misses L1 and L2 waits this long at most.
EMBED_TIMEOUT_S = 0.5


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """L1 and L2, what an entry may be, and what scopes keys."""

    l1_bytes: int = DEFAULT_L1_BYTES
    #: Default L1 policy of a tenant partition.
    policy: Policy = Policy.LRU
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES
    l2_ttl_s: float = DEFAULT_L2_TTL_S
    l2_max_entry_bytes: int = DEFAULT_L2_MAX_ENTRY_BYTES
    #: Entry TTL of tenants the operator sets none for, seconds (0: only --l2-ttl bounds L2).
    ttl_s: float = 0.0
    #: Request header whose value partitions a tenant's entries (docs: invalidation).
    namespace_header: str = DEFAULT_NAMESPACE_HEADER
    model_version: str = ""
    collapse_whitespace: bool = False
    cache_nondeterministic: bool = False
    #: Prices per 1k (prompt, completion) tokens by model (--price-table; "*": any model).
    price_table: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SemanticSettings:
    """The semantic tier (L3, docs/semantic.md)."""

    #: Embedding source: none, upstream, local[:cpu|cuda], hashed, or a URL.
    source: str = "none"
    #: L3 for tenants the operator does not configure (off: opt-in per tenant).
    default_on: bool = False
    threshold: float = DEFAULT_THRESHOLD
    tenant_bytes: int = DEFAULT_TENANT_BYTES
    #: Model named in /v1/embeddings requests (empty: the request's own model).
    embeddings_model: str = ""
    #: Seconds an L3 lookup waits for its embedding before the request goes upstream.
    timeout_s: float = EMBED_TIMEOUT_S
    #: L3 in shadow mode for tenants the operator does not say: measure, never serve.
    shadow: bool = False
    #: Share of would-be L3 hits that shadow mode compares with upstream's answer.
    shadow_sample: float = 1.0
