"""Names in Redis: every key and pub/sub channel of a cache, and the names allowed in them.

Nobody else spells a key by hand. Keys of a cache's control state share the
hashtag ``{cf:<cache>}`` (one cluster slot); each listed tenant's data shares
``{cf:<cache>|<tenant>}``. Unlisted tenants ("guests", ``tenantDefaults``) share
one slot, ``{cf:<cache>|_guests}``: each guest keeps its own key scope there
(``...:g:<guest>:``: its entries and tombstone) and all of them one byte
budget and one fence (the pool's, ``...:p:``: a fence's fields are scopes, and
a guest's own scopes name it, so one hash fences every guest and a cache-wide
invalidation raises it once, not once per guest). A guest goes by
:func:`guest` (``_guests/<guest>``) wherever the functions below take a tenant.
The layout is described in docs/redis-protocol.md.
Pure: no pydantic, no Redis client.
"""

from __future__ import annotations

import re
from enum import StrEnum

#: Tenant and pod names that may appear in keys and metric labels.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class Policy(StrEnum):
    """L1 replacement policy of a tenant partition."""

    LRU = "lru"
    LIRS = "lirs"
    SITS = "sits"


def valid_name(value: str) -> bool:
    """True if ``value`` may be used as a tenant or pod name in keys and labels (the whole
    of it: ``$`` alone would let a trailing newline through)."""
    return NAME_RE.fullmatch(value) is not None


def cache_ref(namespace: str, name: str) -> str:
    """The identity of an InferenceCache in keys: ``<namespace>/<name>``."""
    return f"{namespace}/{name}"


# --------------------------------------------------------------------------- keys


def _control(cache: str) -> str:
    return f"cf:{{cf:{cache}}}"


def quotas_key(cache: str) -> str:
    return f"{_control(cache)}:quotas"


def members_key(cache: str) -> str:
    return f"{_control(cache)}:members"


def member_key(cache: str, pod: str) -> str:
    return f"{_control(cache)}:member:{pod}"


def tombstone_key(cache: str) -> str:
    return f"{_control(cache)}:deleted"


def control_channel(cache: str) -> str:
    return f"{_control(cache)}:control"


def control_prefix(cache: str) -> str:
    """Prefix of every control key of ``cache`` (for cleanup by SCAN MATCH)."""
    return f"{_control(cache)}:"


def fleet_samples_key(cache: str) -> str:
    """Stream of the sidecars' fleet-sampled accesses (contract.fleet)."""
    return f"{_control(cache)}:fleet-samples"


#: The slot of every guest's data (not a valid tenant name: it cannot collide with one).
GUEST_POOL = "_guests"
_GUEST_PREFIX = f"{GUEST_POOL}/"


def guest(tenant: str) -> str:
    """The name of unlisted tenant ``tenant`` in L2 keys: its own scope in the guests' slot."""
    return f"{_GUEST_PREFIX}{tenant}"


#: The guests' pool as a whole, where a tenant is taken: its byte accounting (limit, usage).
GUESTS = _GUEST_PREFIX


def is_guest_name(name: str) -> bool:
    """True for a name made by :func:`guest`."""
    return name.startswith(_GUEST_PREFIX)


def _tenant(cache: str, tenant: str) -> str:
    """The key scope of ``tenant``'s entries and tombstone."""
    if tenant.startswith(_GUEST_PREFIX):
        return f"cf:{{cf:{cache}|{GUEST_POOL}}}:g:{tenant[len(_GUEST_PREFIX) :]}"
    return f"cf:{{cf:{cache}|{tenant}}}"


def _account(cache: str, tenant: str) -> str:
    """The scope of ``tenant``'s byte accounting and fence (a guest's: the pool's)."""
    if tenant.startswith(_GUEST_PREFIX):
        return f"cf:{{cf:{cache}|{GUEST_POOL}}}:p"
    return f"cf:{{cf:{cache}|{tenant}}}"


def guest_usage_key(cache: str, tenant: str) -> str:
    """A guest's own bytes in the pool (hash field ``bytes``), kept by the L2 scripts.

    The scripts spell this key, and :func:`guest_lru_key`, from the entry key
    (:data:`~cachefleet_common.contract.lua.GUEST_OWNER_PATTERN`).
    """
    return f"{_tenant(cache, guest(tenant))}:usage"


def guest_lru_key(cache: str, tenant: str) -> str:
    """A guest's own entries by last use (its share of the pool is evicted from it)."""
    return f"{_tenant(cache, guest(tenant))}:lru"


def own_lru_key(cache: str, tenant: str) -> str:
    """The LRU of ``tenant``'s own entries: :func:`lru_key`, or a guest's own, not the pool's."""
    if tenant.startswith(_GUEST_PREFIX):
        return f"{_tenant(cache, tenant)}:lru"
    return lru_key(cache, tenant)


def entry_key(cache: str, tenant: str, digest_hex: str) -> str:
    return f"{_tenant(cache, tenant)}:e:{digest_hex}"


def usage_key(cache: str, tenant: str) -> str:
    return f"{_account(cache, tenant)}:usage"


def lru_key(cache: str, tenant: str) -> str:
    return f"{_account(cache, tenant)}:lru"


def sizes_key(cache: str, tenant: str) -> str:
    return f"{_account(cache, tenant)}:sizes"


def expiry_key(cache: str, tenant: str) -> str:
    return f"{_account(cache, tenant)}:exp"


def l2_keys(cache: str, tenant: str, digest_hex: str) -> list[str]:
    """KEYS of :data:`~cachefleet_common.contract.lua.L2_PUT_LUA` (and the others on one entry)."""
    return [entry_key(cache, tenant, digest_hex), *l2_meta_keys(cache, tenant)]


def l2_meta_keys(cache: str, tenant: str) -> list[str]:
    """KEYS of :data:`~cachefleet_common.contract.lua.L2_USAGE_LUA`: usage, lru, sizes, exp."""
    return [
        usage_key(cache, tenant),
        lru_key(cache, tenant),
        sizes_key(cache, tenant),
        expiry_key(cache, tenant),
    ]


def tenant_data_pattern(cache: str) -> str:
    """SCAN MATCH pattern for every data key of every tenant of ``cache``."""
    escaped = cache.replace("[", "\\[").replace("]", "\\]").replace("*", "\\*")
    return f"cf:{{cf:{escaped}|*"


def epochs_key(cache: str) -> str:
    """The sequencer: scope -> epoch (control slot)."""
    return f"{_control(cache)}:epochs"


def l2_tenants_key(cache: str) -> str:
    """Set of tenants with L2 data (control slot)."""
    return f"{_control(cache)}:tenants"


def acks_key(cache: str) -> str:
    """Hash pod -> JSON :class:`EpochAck` (control slot)."""
    return f"{_control(cache)}:acks"


def ack_channel(cache: str) -> str:
    """Pub/sub channel on which every acknowledgement is also announced."""
    return f"{_control(cache)}:acked"


def tenant_epochs_key(cache: str, tenant: str) -> str:
    """The fence of one tenant's data slot: scope -> epoch (every guest's: the pool's).

    Guests share one: a reader asks it only for its own vector's scopes (``cache``,
    ``model:<m>``, ``purge``, and ``tenant:<guest>``, ``namespace:<guest>/...``,
    which no other guest's vector has), so sharing it changes no verdict.
    """
    return f"{_account(cache, tenant)}:epochs"


def tenant_tombstone_key(cache: str, tenant: str) -> str:
    """The tombstone of one tenant's data slot (a deleted cache; see :func:`tombstone_key`)."""
    return f"{_tenant(cache, tenant)}:deleted"


def l2_versioned_keys(cache: str, tenant: str, digest_hex: str) -> list[str]:
    """KEYS of the versioned L2 scripts: :func:`l2_keys`, the tenant's fence and tombstone."""
    return [
        *l2_keys(cache, tenant, digest_hex),
        tenant_epochs_key(cache, tenant),
        tenant_tombstone_key(cache, tenant),
    ]


#: What a purge names: the SHA-256 hex digest of an entry's key (``X-Cache-Key``).
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


def purge_log_key(cache: str) -> str:
    """The purge log: sorted set ``<seq>:<digest>`` -> seq (control slot)."""
    return f"{_control(cache)}:purges"


def check_digest(digest: str) -> str:
    """``digest`` if it is a SHA-256 hex digest (64 lower-case hex digits); else ValueError."""
    if not DIGEST_RE.match(digest):
        raise ValueError(f"not a SHA-256 hex digest (64 of 0-9a-f): {digest[:80]!r}")
    return digest


def rate_limit_key(cache: str, tenant: str) -> str:
    """The GCRA state of ``tenant``'s request and token limits (hash ``r``, ``t``, ``d``),
    in the tenant's data slot (:data:`~cachefleet_common.contract.lua.RATE_LIMIT_LUA`)."""
    return f"{_tenant(cache, tenant)}:rl"
