"""Sidecar configuration: one frozen record of the rooms' own settings records.

Each room owns its settings (``http/settings.py``, ``cache/settings.py``,
``tenancy/settings.py``, ``adapt/settings.py``, ``observe/settings.py``,
``control/settings.py``) with their defaults beside its code; :class:`SidecarConfig`
(the top floor) holds one of each, plus what the process itself is (where it
listens, which cache and pod, Redis). No room below the top floor imports it:
the composition root hands each room its own record.

:func:`parse_args` reads the command line and the environment (the flags are
declared in :mod:`cachefleet_sidecar.flags`); :meth:`SidecarConfig.from_flat`
builds a configuration from flat setting names (tests, embedding).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field, fields
from typing import Any

from cachefleet_sidecar import flags
from cachefleet_sidecar.adapt.settings import AdaptSettings
from cachefleet_sidecar.cache.settings import CacheSettings, SemanticSettings
from cachefleet_sidecar.control.settings import ControlSettings
from cachefleet_sidecar.flags import DEFAULT_CACHE, DEFAULT_SHUTDOWN_GRACE_S
from cachefleet_sidecar.http.server import Limits
from cachefleet_sidecar.http.settings import HttpSettings
from cachefleet_sidecar.observe.settings import ObserveSettings
from cachefleet_sidecar.tenancy.settings import TenancySettings


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    """What the process is, and each room's settings."""

    listen: tuple[str, int] = ("0.0.0.0", 8080)
    #: None: the admin endpoints are served on ``listen``.
    admin_listen: tuple[str, int] | None = ("127.0.0.1", 8081)
    #: NAMESPACE/NAME of the InferenceCache this sidecar belongs to.
    cache: str = DEFAULT_CACHE
    pod: str = field(default_factory=socket.gethostname)
    #: Redis for L2, quotas and epochs; None: L1 only.
    redis_url: str | None = None
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    log_level: str = "info"
    http: HttpSettings = field(default_factory=HttpSettings)
    caching: CacheSettings = field(default_factory=CacheSettings)
    semantic: SemanticSettings = field(default_factory=SemanticSettings)
    tenancy: TenancySettings = field(default_factory=TenancySettings)
    adapt: AdaptSettings = field(default_factory=AdaptSettings)
    observe: ObserveSettings = field(default_factory=ObserveSettings)
    control: ControlSettings = field(default_factory=ControlSettings)

    @classmethod
    def from_flat(cls, **settings: Any) -> SidecarConfig:
        """A configuration from flat names: ``from_flat(cache="ns/c", l1_bytes=1 << 20)``.

        Each name goes to the record that owns it (the semantic tier's by their
        ``semantic_`` name, the client limits' by their own); anything not given
        keeps its default. A name no record has raises :class:`TypeError`.
        """
        top: dict[str, Any] = {}
        grouped: dict[str, dict[str, Any]] = {group: {} for group in _GROUPS}
        limits: dict[str, Any] = {}
        for name, value in settings.items():
            if name in _TOP:
                top[name] = value
            elif name in _LIMITS:
                limits[name] = value
            elif name in _OWNER:
                group, field_name = _OWNER[name]
                grouped[group][field_name] = value
            else:
                raise TypeError(f"SidecarConfig has no setting {name!r}")
        if limits:
            grouped["http"]["limits"] = Limits(**limits)
        records = {group: kind(**grouped[group]) for group, (kind, _) in _GROUPS.items()}
        return cls(**top, **records)


#: Each room's record in :class:`SidecarConfig`, and the prefix of its fields' flat names.
_GROUPS: dict[str, tuple[Any, str]] = {
    "http": (HttpSettings, ""),
    "caching": (CacheSettings, ""),
    "semantic": (SemanticSettings, "semantic_"),
    "tenancy": (TenancySettings, ""),
    "adapt": (AdaptSettings, ""),
    "observe": (ObserveSettings, ""),
    "control": (ControlSettings, ""),
}
_TOP = {f.name for f in fields(SidecarConfig)} - set(_GROUPS)
_LIMITS = {f.name for f in fields(Limits)}
#: Flat name -> (record, field).
_OWNER = {
    prefix + f.name: (group, f.name)
    for group, (kind, prefix) in _GROUPS.items()
    for f in fields(kind)
    if f.name != "limits"
}


def parse_args(argv: list[str]) -> SidecarConfig:
    """Parse flags (and environment) into a config; exit 2 with a clear message on bad input."""
    ns = flags.sidecar_flags().parse(argv)
    return SidecarConfig(
        listen=ns.listen,
        admin_listen=ns.admin_listen,
        cache=ns.cache,
        pod=ns.pod,
        redis_url=ns.redis_url,
        shutdown_grace_s=ns.shutdown_grace,
        log_level=ns.log_level,
        http=flags.http_settings(ns),
        caching=flags.cache_settings(ns),
        semantic=flags.semantic_settings(ns),
        tenancy=flags.tenancy_settings(ns),
        adapt=flags.adapt_settings(ns),
        observe=flags.observe_settings(ns),
        control=flags.control_settings(ns),
    )
