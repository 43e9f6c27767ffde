"""Invalidation epochs as one sidecar knows them (pure: no I/O, no Redis).

An *epoch* is a counter per *scope* that only moves forward; advancing it
invalidates every cache entry written under the old value. Three kinds of
scope exist (their names are hash fields in Redis, see
docs/redis-protocol.md):

* ``cache``         the whole cache;
* ``tenant:<t>``    one tenant's entries;
* ``model:<m>``     one model's entries (a new model version bumps it);
* ``namespace:<t>/<n>`` the entries of namespace ``n`` of tenant ``t`` (the
  ``X-Cache-Namespace`` request header partitions a tenant, e.g. one
  namespace per knowledge base);
* ``purge``         the sequence number of key purges (one entry each, see
  docs/redis-protocol.md, "key purges"). It is *fence-only*: L2
  reads and writes are checked against it, but it is no part of a key nor
  of an entry's head, so a purge moves no other entry.

Every cache key carries the epochs that apply to it (cache, its tenant, its
model and, for a namespaced request, its namespace), so once a sidecar knows
a newer epoch it can no longer even *find* an older entry, in L1 or in L2.

:class:`EpochTracker` holds the epochs one sidecar knows and when it last
*confirmed* them, i.e. read the whole epoch hash from Redis (the sequencer):

* :meth:`EpochTracker.merge` takes epochs from a pub/sub notice: max-merge,
  so a duplicated or reordered message changes nothing and never moves an
  epoch back; it does not count as a confirmation (a notice says "at least
  this", not "nothing else moved");
* :meth:`EpochTracker.confirm` takes the authoritative hash read at
  ``sent_at`` (the time the read was *sent*, so the bound is conservative);
  it reports scopes where Redis is *behind* what the sidecar knows (Redis
  restarted without persistence) so the caller can put them back;
* :attr:`EpochTracker.valid_until` = last confirmation + staleness bound. The
  request path compares it with the clock (one float comparison): past it,
  L1 hits are not served (they fall through to L2, whose script checks the
  epoch itself, or upstream) until a confirmation succeeds again;
* :attr:`EpochTracker.version` moves whenever a known epoch moves, so callers
  can tell a key computed before a change from one computed after it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

#: How long confirmed epochs stay good for serving L1 hits, seconds.
DEFAULT_STALENESS_BOUND_S = 2.0
#: Scope name of the whole cache.
CACHE_SCOPE = "cache"
_TENANT_PREFIX = "tenant:"
_MODEL_PREFIX = "model:"
_NAMESPACE_PREFIX = "namespace:"
#: Scope name of the key-purge sequence (fence-only: never in a key or an entry's head).
PURGE_SCOPE = "purge"
#: Most (tenant, model) vectors EpochTracker.vector keeps built.
_VECTORS_LIMIT = 4096

#: The epochs an entry is written under: ((scope, epoch), ...) in a fixed order.
EpochVector = tuple[tuple[str, int], ...]


def tenant_scope(tenant: str) -> str:
    """Scope name of one tenant."""
    return f"{_TENANT_PREFIX}{tenant}"


def model_scope(model: str) -> str:
    """Scope name of one model."""
    return f"{_MODEL_PREFIX}{model}"


def namespace_scope(tenant: str, namespace: str) -> str:
    """Scope name of one namespace of one tenant (tenant names hold no ``/``)."""
    return f"{_NAMESPACE_PREFIX}{tenant}/{namespace}"


def valid_scope(scope: str) -> bool:
    """True for ``cache``, ``purge``, ``tenant:<t>``, ``model:<m>``, ``namespace:<t>/<n>``."""
    if scope in (CACHE_SCOPE, PURGE_SCOPE):
        return True
    if scope.startswith(_NAMESPACE_PREFIX):
        tenant, slash, namespace = scope[len(_NAMESPACE_PREFIX) :].partition("/")
        return bool(tenant and slash and namespace)
    for prefix in (_TENANT_PREFIX, _MODEL_PREFIX):
        if scope.startswith(prefix) and len(scope) > len(prefix):
            return True
    return False


def encode_vector(vector: EpochVector) -> str:
    """Wire form of a vector, as L2 stores it next to an entry: ``cache=3;tenant:a=1``.

    The fence-only ``purge`` scope is left out: an entry's head names only
    the epochs that version it.
    """
    return ";".join(f"{scope}={epoch}" for scope, epoch in vector if scope != PURGE_SCOPE)


def parse_epochs(raw: Mapping[bytes | str, bytes | str | int]) -> dict[str, int]:
    """An epoch hash as Redis returns it -> {scope: epoch}; junk fields are dropped."""
    out: dict[str, int] = {}
    for name, value in raw.items():
        scope = name.decode() if isinstance(name, bytes) else str(name)
        try:
            epoch = int(value)
        except (TypeError, ValueError):
            continue
        if valid_scope(scope) and epoch >= 0:
            out[scope] = epoch
    return out


def covers(known: Mapping[str, int], wanted: Mapping[str, int]) -> bool:
    """True when ``known`` is at least ``wanted`` in every scope of ``wanted``."""
    return all(known.get(scope, 0) >= epoch for scope, epoch in wanted.items())


@dataclass(frozen=True, slots=True)
class Confirmation:
    """What one authoritative read changed."""

    #: A known epoch moved forward.
    changed: bool
    #: Scopes where Redis holds less than the sidecar knows: {scope: known epoch}.
    redis_behind: dict[str, int] = field(default_factory=dict)


class EpochTracker:
    """The epochs one sidecar knows, monotone, with the time they were last confirmed."""

    def __init__(
        self,
        bound_s: float = DEFAULT_STALENESS_BOUND_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if bound_s <= 0:
            raise ValueError("the staleness bound must be positive")
        self.bound_s = bound_s
        self.clock = clock
        self._known: dict[str, int] = {}
        #: Moves whenever a known epoch moves forward.
        self.version = 0
        #: vector() per (tenant, model), valid while version is _vectors_version
        self._vectors: dict[tuple[str, str, str], EpochVector] = {}
        self._vectors_version = 0
        #: clock() at which the last confirmed read was sent; None before the first.
        self.confirmed_at: float | None = None
        #: L1 hits may be served while clock() < valid_until.
        self.valid_until = -math.inf

    @property
    def known(self) -> dict[str, int]:
        """A copy of the known epochs (scopes never seen are 0)."""
        return dict(self._known)

    def epoch(self, scope: str) -> int:
        return self._known.get(scope, 0)

    def fresh(self, now: float | None = None) -> bool:
        """True while the last confirmation is within the staleness bound."""
        return (self.clock() if now is None else now) < self.valid_until

    def merge(self, epochs: Mapping[str, int]) -> bool:
        """Max-merge ``epochs`` (a notice); True if anything moved forward."""
        changed = False
        for scope, epoch in epochs.items():
            if not valid_scope(scope):
                continue
            if epoch > self._known.get(scope, 0):
                self._known[scope] = int(epoch)
                changed = True
        if changed:
            self.version += 1
        return changed

    def confirm(self, authoritative: Mapping[str, int], sent_at: float) -> Confirmation:
        """Apply the whole epoch hash, read by a request sent at ``sent_at`` (clock time)."""
        changed = self.merge(authoritative)
        behind = {
            scope: epoch
            for scope, epoch in self._known.items()
            if epoch > authoritative.get(scope, 0)
        }
        if self.confirmed_at is None or sent_at > self.confirmed_at:
            self.confirmed_at = sent_at
            self.valid_until = sent_at + self.bound_s
        return Confirmation(changed, behind)

    def expire(self) -> None:
        """Forget the last confirmation (L1 is off until the next one)."""
        self.confirmed_at = None
        self.valid_until = -math.inf

    def values_for(self, tenant: str, model: str, namespace: str = "") -> tuple[int, ...]:
        """(cache, tenant, model[, namespace]) epochs that scope a key (the namespace's
        only for a namespaced request)."""
        known = self._known
        values = (
            known.get(CACHE_SCOPE, 0),
            known.get(_TENANT_PREFIX + tenant, 0),
            known.get(_MODEL_PREFIX + model, 0),
        )
        if namespace:
            return (*values, known.get(namespace_scope(tenant, namespace), 0))
        return values

    def vector(self, tenant: str, model: str, namespace: str = "") -> EpochVector:
        """The same epochs with their scope names, then ``purge`` (what L2 checks and records).

        Built once per (tenant, model, namespace) until an epoch moves: every L2
        lookup asks.
        """
        vectors = self._vectors
        if self._vectors_version != self.version or len(vectors) >= _VECTORS_LIMIT:
            vectors.clear()
            self._vectors_version = self.version
        vector = vectors.get((tenant, model, namespace))
        if vector is None:
            values = self.values_for(tenant, model, namespace)
            scopes = [CACHE_SCOPE, tenant_scope(tenant), model_scope(model)]
            if namespace:
                scopes.append(namespace_scope(tenant, namespace))
            built = [*zip(scopes, values, strict=True)]
            built.append((PURGE_SCOPE, self._known.get(PURGE_SCOPE, 0)))
            vector = vectors[tenant, model, namespace] = tuple(built)
        return vector
