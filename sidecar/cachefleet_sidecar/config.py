"""Sidecar configuration: command-line flags, each also read from ``CACHEFLEET_<FLAG>``.

Flags win over the environment; the environment (what the Helm chart and the
injection webhook set) wins over the defaults. Bad values end the process
with a message naming the flag and the environment variable.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import orjson

from . import protocol
from .epochs import DEFAULT_STALENESS_BOUND_S

DEFAULT_LISTEN = "0.0.0.0:8080"
DEFAULT_ADMIN_LISTEN = "0.0.0.0:8081"
DEFAULT_UPSTREAM = "http://127.0.0.1:8000"
DEFAULT_L1_BYTES = 256 * 1024 * 1024
DEFAULT_L2_TTL_S = 3600.0
#: Seconds the model server may stay silent before the request fails with 504.
DEFAULT_UPSTREAM_TIMEOUT_S = 600.0
DEFAULT_SHUTDOWN_GRACE_S = 30.0
DEFAULT_MAX_TENANTS = 64
DEFAULT_CACHE = "default/default"
ENV_PREFIX = "CACHEFLEET_"


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return (host.strip("[]") or "0.0.0.0"), int(port)


def _size(value: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}
    text = value.strip().lower().removesuffix("b")
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix) and text[: -len(suffix)].isdigit():
            return int(text[: -len(suffix)]) * units[suffix]
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(
        f"expected a byte count such as 268435456 or 256Mi, got {value!r}"
    )


def _cache(value: str) -> str:
    ns, sep, name = value.partition("/")
    if not sep or not protocol.valid_name(ns) or not protocol.valid_name(name):
        raise argparse.ArgumentTypeError(f"expected NAMESPACE/NAME, got {value!r}")
    return value


def _tenant(value: str) -> str:
    if not protocol.valid_name(value):
        raise argparse.ArgumentTypeError(
            f"tenant names are 1-63 characters of [A-Za-z0-9._-], got {value!r}"
        )
    return value


def _window(value: str) -> float:
    seconds = float(value)
    if not (seconds == 0 or 0.1 <= seconds <= 3600):
        raise argparse.ArgumentTypeError(f"0 (off) or 0.1-3600 seconds expected, got {value!r}")
    return seconds


@dataclass(frozen=True)
class SidecarConfig:
    listen: tuple[str, int] = ("0.0.0.0", 8080)
    admin_listen: tuple[str, int] | None = ("0.0.0.0", 8081)
    upstream: str = DEFAULT_UPSTREAM
    redis_url: str | None = None
    cache: str = DEFAULT_CACHE
    pod: str = field(default_factory=socket.gethostname)
    l1_bytes: int = DEFAULT_L1_BYTES
    policy: protocol.Policy = protocol.Policy.LRU
    tenant_header: str = "X-Tenant-ID"
    default_tenant: str | None = None
    tenants: tuple[str, ...] = ()
    api_keys: dict[str, str] = field(default_factory=dict)
    model_version: str = ""
    collapse_whitespace: bool = False
    cache_nondeterministic: bool = False
    l2_ttl_s: float = DEFAULT_L2_TTL_S
    upstream_timeout_s: float = DEFAULT_UPSTREAM_TIMEOUT_S
    staleness_bound_s: float = DEFAULT_STALENESS_BOUND_S
    max_tenants: int = DEFAULT_MAX_TENANTS
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    log_level: str = "info"
    #: Window of the policy switching engine, seconds; 0 turns switching off.
    switch_window_s: float = 10.0


def _env(name: str) -> str | None:
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cachefleet sidecar",
        description="Caching reverse proxy in front of an OpenAI-compatible model server. "
        "Every flag can also be set as CACHEFLEET_<FLAG> (e.g. CACHEFLEET_REDIS_URL).",
    )

    def add(flag: str, help_text: str, **kw: Any) -> None:
        env = _env(flag)
        if env is not None:
            kw["default"] = env if kw.get("action") is None else env.lower() in {"1", "true", "yes"}
        p.add_argument(
            f"--{flag}",
            help=f"{help_text} [env {ENV_PREFIX}{flag.upper().replace('-', '_')}]",
            **kw,
        )

    add("listen", "HOST:PORT of the proxy", default=DEFAULT_LISTEN)
    add(
        "admin-listen",
        "HOST:PORT of /healthz /readyz /status /metrics ('off' to serve them on --listen)",
        default=DEFAULT_ADMIN_LISTEN,
    )
    add("upstream", "URL of the model server", default=DEFAULT_UPSTREAM)
    add(
        "redis-url",
        "Redis for L2 and quotas (redis://H:P, rediss://, redis+cluster://H1:P1,H2:P2); "
        "without it the sidecar runs L1 only",
        default=None,
    )
    add(
        "cache",
        "NAMESPACE/NAME of the InferenceCache this sidecar belongs to",
        default=DEFAULT_CACHE,
    )
    add(
        "pod",
        "this pod's name in heartbeats",
        default=os.environ.get("POD_NAME") or socket.gethostname(),
    )
    add("l1-bytes", "L1 size in bytes (256Mi, 1Gi, ...)", default=str(DEFAULT_L1_BYTES))
    add("policy", "default L1 policy: lru | lirs | sits", default="lru")
    add(
        "switch-window",
        "seconds per window of the P99-driven LIRS -> SITS switching engine; 0: off",
        default="10",
    )
    add("tenant-header", "request header that names the tenant", default="X-Tenant-ID")
    add(
        "default-tenant",
        "tenant for requests that name none (or an unknown one); without it they get 403",
        default=None,
    )
    add(
        "tenants",
        "comma-separated known tenants (the operator's quotas add to them); empty: any valid name",
        default="",
    )
    add(
        "api-keys-file",
        "JSON file mapping API keys (Authorization: Bearer) to tenants",
        default=None,
    )
    add("model-version", "model version that scopes cache keys", default="")
    add(
        "collapse-whitespace",
        "collapse whitespace runs inside message text when keying",
        action="store_true",
        default=False,
    )
    add(
        "cache-nondeterministic",
        "also cache requests with temperature > 0 and no seed",
        action="store_true",
        default=False,
    )
    add("l2-ttl", "L2 entry TTL, seconds", default=str(DEFAULT_L2_TTL_S))
    add(
        "staleness-bound",
        "seconds without confirmed invalidation epochs after which L1 hits stop",
        default=str(DEFAULT_STALENESS_BOUND_S),
    )
    add(
        "upstream-timeout",
        "seconds the model server may stay silent mid-request (504 after that)",
        default=str(DEFAULT_UPSTREAM_TIMEOUT_S),
    )
    add("max-tenants", "most tenant partitions in L1", default=str(DEFAULT_MAX_TENANTS))
    add(
        "shutdown-grace",
        "seconds to finish in-flight requests on SIGTERM",
        default=str(DEFAULT_SHUTDOWN_GRACE_S),
    )
    add("log-level", "debug | info | warning | error", default="info")
    return p


def parse_args(argv: list[str]) -> SidecarConfig:
    """Parse flags (and environment) into a config; exit 2 with a clear message on bad input."""
    parser = build_parser()
    ns = parser.parse_args(argv)

    def conv(flag: str, value: object, fn: object) -> object:
        try:
            return fn(value)  # type: ignore[operator]
        except (argparse.ArgumentTypeError, ValueError) as exc:
            parser.error(f"--{flag}: {exc}")

    api_keys: dict[str, str] = {}
    if ns.api_keys_file:
        try:
            with open(ns.api_keys_file, "rb") as fh:
                loaded = orjson.loads(fh.read())
        except (OSError, orjson.JSONDecodeError) as exc:
            parser.error(f"--api-keys-file: {exc}")
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and protocol.valid_name(v)
            for k, v in loaded.items()
        ):
            parser.error("--api-keys-file: expected a JSON object of api-key -> tenant name")
        api_keys = loaded
    try:
        policy = protocol.Policy(ns.policy)
    except ValueError:
        parser.error(f"--policy: expected one of lru, lirs, sits, got {ns.policy!r}")
    admin = None if str(ns.admin_listen).lower() in {"off", "none", ""} else ns.admin_listen
    tenants = tuple(
        str(conv("tenants", t.strip(), _tenant)) for t in str(ns.tenants).split(",") if t.strip()
    )
    return SidecarConfig(
        listen=conv("listen", ns.listen, _host_port),  # type: ignore[arg-type]
        admin_listen=None if admin is None else conv("admin-listen", admin, _host_port),  # type: ignore[arg-type]
        upstream=ns.upstream,
        redis_url=ns.redis_url or None,
        cache=str(conv("cache", ns.cache, _cache)),
        pod=str(conv("pod", ns.pod, _tenant)),
        l1_bytes=int(conv("l1-bytes", str(ns.l1_bytes), _size)),  # type: ignore[call-overload]
        policy=policy,
        tenant_header=ns.tenant_header,
        default_tenant=None
        if not ns.default_tenant
        else str(conv("default-tenant", ns.default_tenant, _tenant)),
        tenants=tenants,
        api_keys=api_keys,
        model_version=ns.model_version,
        collapse_whitespace=bool(ns.collapse_whitespace),
        cache_nondeterministic=bool(ns.cache_nondeterministic),
        l2_ttl_s=float(conv("l2-ttl", ns.l2_ttl, float)),  # type: ignore[arg-type]
        upstream_timeout_s=float(conv("upstream-timeout", ns.upstream_timeout, float)),  # type: ignore[arg-type]
        staleness_bound_s=float(conv("staleness-bound", ns.staleness_bound, float)),  # type: ignore[arg-type]
        max_tenants=int(conv("max-tenants", ns.max_tenants, int)),  # type: ignore[call-overload]
        shutdown_grace_s=float(conv("shutdown-grace", ns.shutdown_grace, float)),  # type: ignore[arg-type]
        log_level=ns.log_level,
        switch_window_s=float(conv("switch-window", ns.switch_window, _window)),  # type: ignore[arg-type]
    )
