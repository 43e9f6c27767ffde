"""L1 replacement policies and the factory that builds them by name.

Names are the values of :class:`cachefleet_common.contract.names.Policy` (a
pure module: this package stays free of I/O libraries).
A policy is a pure, byte-bounded data structure (see :mod:`.base` for the
contract); ``make_policy`` is how the rest of the sidecar gets one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cachefleet_common.contract.names import Policy
from cachefleet_sidecar.policies.base import K, ReplacementPolicy, V
from cachefleet_sidecar.policies.lirs import LIRSPolicy, LirsSnapshot
from cachefleet_sidecar.policies.lru import LRUPolicy
from cachefleet_sidecar.policies.sits import SITSPolicy

__all__ = [
    "LIRS",
    "LRU",
    "SITS",
    "LIRSPolicy",
    "LRUPolicy",
    "LirsSnapshot",
    "ReplacementPolicy",
    "SITSPolicy",
    "available_policies",
    "make_policy",
]

#: Policy names, the values of :class:`Policy`.
LRU = Policy.LRU.value
LIRS = Policy.LIRS.value
SITS = Policy.SITS.value

_FACTORIES: dict[str, Callable[[int], ReplacementPolicy[Any, Any]]] = {
    LRU: LRUPolicy,
    LIRS: LIRSPolicy,
    SITS: SITSPolicy,
}


def available_policies() -> tuple[str, ...]:
    """Names ``make_policy`` accepts, in a stable order."""
    return tuple(_FACTORIES)


def make_policy(name: str, capacity_bytes: int) -> ReplacementPolicy[K, V]:
    """A new, empty policy called ``name`` holding at most ``capacity_bytes``.

    Raises ``ValueError`` naming the policy if there is no such policy (or it
    is not implemented in this version).
    """
    factory = _FACTORIES.get(str(name))
    if factory is None:
        raise ValueError(
            f"unknown L1 policy {str(name)!r}; available: {', '.join(available_policies())}"
        )
    return factory(capacity_bytes)
