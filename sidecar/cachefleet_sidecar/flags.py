"""The sidecar's command line: its flags, each also ``CACHEFLEET_<FLAG>``, by room.

Declared on the one flag mechanism (:class:`cachefleet_common.flags.Flags`):
the flag wins over the environment (what the Helm chart and the injection
webhook set), which wins over the default, and every value goes through the
flag's own parser; a bad one ends the process with exit status 2 naming the
flag and where the value came from. One ``add_<group>_flags`` per settings
record, and one function per record that builds it from the parsed values;
:func:`cachefleet_sidecar.config.parse_args` puts them together.
"""

from __future__ import annotations

import argparse
import re
import socket
from collections.abc import Callable, Mapping
from typing import Any

from cachefleet_common import classes, prices
from cachefleet_common.contract.fleet import FLEET_SAMPLE_RATE
from cachefleet_common.contract.names import Policy, valid_name
from cachefleet_common.epochs import DEFAULT_STALENESS_BOUND_S
from cachefleet_common.flags import Flags
from cachefleet_common.limits import limits_flag
from cachefleet_common.sampling import DEFAULT_MAX_RATE, DEFAULT_MAX_SAMPLES
from cachefleet_common.values import byte_size, cache_ref, otlp_url
from cachefleet_sidecar.adapt import admission, flows
from cachefleet_sidecar.adapt.settings import AdaptSettings
from cachefleet_sidecar.adapt.switching import DEFAULT_WINDOW_S
from cachefleet_sidecar.cache import settings as cache_defaults
from cachefleet_sidecar.cache.embeddings import check_source
from cachefleet_sidecar.cache.settings import CacheSettings, SemanticSettings
from cachefleet_sidecar.control.settings import ControlSettings
from cachefleet_sidecar.control.warm import DEFAULT_WARM_TIMEOUT_S
from cachefleet_sidecar.http import settings as http_defaults
from cachefleet_sidecar.http.server import Limits
from cachefleet_sidecar.http.settings import HttpSettings
from cachefleet_sidecar.observe.settings import DEFAULT_STATUS_PEERS, ObserveSettings
from cachefleet_sidecar.tenancy import identity
from cachefleet_sidecar.tenancy import settings as tenancy_defaults
from cachefleet_sidecar.tenancy.settings import TenancySettings

DEFAULT_LISTEN = "0.0.0.0:8080"
#: Loopback by default; in a pod the injection webhook binds 0.0.0.0 for the kubelet and Prometheus.
DEFAULT_ADMIN_LISTEN = "127.0.0.1:8081"
DEFAULT_CACHE = "default/default"
DEFAULT_SHUTDOWN_GRACE_S = 30.0
DESCRIPTION = (
    "Caching reverse proxy in front of an OpenAI-compatible model server. "
    "Every flag can also be set as CACHEFLEET_<FLAG> (e.g. CACHEFLEET_REDIS_URL)."
)
#: Client-side limits (see docs/limits.md): the defaults live with the server.
_LIMITS = Limits()

# ---------------------------------------------------------------------- value parsers


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return (host.strip("[]") or "0.0.0.0"), int(port)


def _admin_listen(value: str) -> tuple[str, int] | None:
    """HOST:PORT, or off (none, empty): the admin endpoints are served on --listen."""
    return None if value.lower() in {"off", "none", ""} else _host_port(value)


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


def _non_negative(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {value!r}")
    return number


def _count(value: str) -> int:
    """A whole number >= 0."""
    number = int(value)
    if number < 0:
        raise ValueError(f"must be >= 0, got {number}")
    return number


def _fraction(value: str) -> float:
    """A share in (0, 1]."""
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


def _optional_tenant(value: str) -> str | None:
    return _tenant(value) if value else None


def _tenants(value: str) -> tuple[str, ...]:
    """Comma-separated tenant names."""
    return tuple(_tenant(t.strip()) for t in value.split(",") if t.strip())


def _networks(value: str) -> tuple[str, ...]:
    """Comma-separated CIDRs."""
    return tuple(str(n) for n in identity.parse_networks(value))


def _api_keys_file(value: str) -> str | None:
    """A keys file that reads (checked now: a typo fails at start, not at the first request)."""
    if not value:
        return None
    try:
        identity.ApiKeys.from_file(value)
    except identity.KeyFileError as exc:
        raise ValueError(str(exc)) from exc
    return value


def _policy(value: str) -> Policy:
    try:
        return Policy(value)
    except ValueError:
        raise ValueError(f"expected one of lru, lirs, sits, got {value!r}") from None


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


def _window(value: str) -> float:
    seconds = float(value)
    if not (seconds == 0 or 0.1 <= seconds <= 3600):
        raise argparse.ArgumentTypeError(f"0 (off) or 0.1-3600 seconds expected, got {value!r}")
    return seconds


def _or_empty(parse: Callable[[str], Any], empty: Callable[[], Any]) -> Callable[[str], Any]:
    """``parse``, except that an empty value is ``empty()`` (a flag left unset)."""
    return lambda value: parse(value) if value else empty()


def _admission_threshold(name: str, kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parser of one admission threshold, checked as :class:`AdmissionConfig` checks it."""

    def parse(value: str) -> Any:
        number = kind(value)
        admission.AdmissionConfig(**{name: number})
        return number

    return parse


def _optional_float(value: str) -> float | None:
    return float(value) if value.strip() else None


# ---------------------------------------------------------------------- flags by group


def add_process_flags(flags: Flags) -> None:
    """Where the sidecar listens, which cache and pod it is, Redis, and its lifetime."""
    group = "process"
    flags.add(
        "listen", "HOST:PORT of the proxy", default=DEFAULT_LISTEN, parse=_host_port, group=group
    )
    flags.add(
        "admin-listen",
        "HOST:PORT of /healthz /readyz /status /metrics ('off' to serve them on --listen); "
        "loopback by default, tenant names in /status only to --status-peers",
        default=DEFAULT_ADMIN_LISTEN,
        parse=_admin_listen,
        group=group,
    )
    flags.add(
        "redis-url",
        "Redis for L2 and quotas (redis://[USER:PASSWORD@]H:P/DB, rediss://...?ssl_ca_certs=CA, "
        "redis+cluster://H1:P1,H2:P2); without it the sidecar runs L1 only",
        parse=lambda value: value or None,
        group=group,
    )
    flags.add(
        "cache",
        "NAMESPACE/NAME of the InferenceCache this sidecar belongs to",
        default=DEFAULT_CACHE,
        parse=cache_ref,
        group=group,
    )
    flags.add(
        "pod",
        "this pod's name in heartbeats",
        default=flags.environ.get("POD_NAME") or socket.gethostname(),
        parse=_tenant,
        group=group,
    )
    flags.add(
        "shutdown-grace",
        "seconds to finish in-flight requests on SIGTERM",
        default=DEFAULT_SHUTDOWN_GRACE_S,
        parse=float,
        group=group,
    )
    flags.add("log-level", "debug | info | warning | error", default="info", group=group)


def add_http_flags(flags: Flags) -> None:
    """The model server: where it is and how many requests go to it at once."""
    group = "upstream"
    flags.add(
        "upstream",
        "URL of the model server; user:password@ in it is sent as Authorization: Basic "
        "(replacing the client's) and never shown",
        default=http_defaults.DEFAULT_UPSTREAM,
        group=group,
    )
    flags.add(
        "upstream-timeout",
        "seconds the model server may stay silent mid-request (504 after that)",
        default=http_defaults.DEFAULT_UPSTREAM_TIMEOUT_S,
        parse=float,
        group=group,
    )
    flags.add(
        "upstream-max-connections",
        "most connections open to the model server at once (requests beyond wait, see "
        "--upstream-max-queued)",
        default=HttpSettings().upstream_max_connections,
        parse=_positive_int,
        group=group,
    )
    flags.add(
        "upstream-max-queued",
        "most requests waiting for a free upstream connection; beyond them 503 (0: none wait)",
        default=HttpSettings().upstream_max_queued,
        parse=_count,
        group=group,
    )


def add_limits_flags(flags: Flags) -> None:
    """What one client may make the sidecar hold (docs/limits.md)."""
    group = "client limits"
    for flag, help_text, default, parse in (
        ("max-url-bytes", "longest request target (414 beyond)", _LIMITS.max_url_bytes, byte_size),
        (
            "max-header-bytes",
            "largest request header block (431 beyond)",
            _LIMITS.max_header_bytes,
            byte_size,
        ),
        ("max-body-bytes", "largest request body (413 beyond)", _LIMITS.max_body_bytes, byte_size),
        (
            "max-body-memory",
            "request body bytes held at once across all connections (503 beyond)",
            _LIMITS.body_memory_bytes,
            byte_size,
        ),
        (
            "max-pipelined",
            "requests queued per connection before the sidecar stops reading from it",
            _LIMITS.max_pipelined,
            _positive_int,
        ),
        (
            "idle-timeout",
            "seconds an idle keep-alive connection is kept",
            _LIMITS.idle_timeout_s,
            _positive_float,
        ),
        (
            "header-timeout",
            "seconds a client has to send a complete request head (408 after)",
            _LIMITS.header_timeout_s,
            _positive_float,
        ),
        (
            "body-timeout",
            "seconds a request body may stall between reads (408 after)",
            _LIMITS.body_timeout_s,
            _positive_float,
        ),
        (
            "send-timeout",
            "seconds a client may leave an answer unread before the connection is dropped",
            _LIMITS.send_timeout_s,
            _positive_float,
        ),
    ):
        flags.add(flag, help_text, default=default, parse=parse, group=group)


def add_cache_flags(flags: Flags) -> None:
    """L1 and L2, what an entry may be, and what scopes keys."""
    group = "cache"
    flags.add(
        "l1-bytes",
        "L1 size in bytes (256Mi, 1Gi, ...)",
        default=cache_defaults.DEFAULT_L1_BYTES,
        parse=byte_size,
        group=group,
    )
    flags.add(
        "policy", "default L1 policy: lru | lirs | sits", default="lru", parse=_policy, group=group
    )
    flags.add("model-version", "model version that scopes cache keys", default="", group=group)
    flags.add(
        "collapse-whitespace",
        "collapse whitespace runs inside message text when keying",
        is_switch=True,
        group=group,
    )
    flags.add(
        "cache-nondeterministic",
        "also cache requests with temperature > 0 and no seed",
        is_switch=True,
        group=group,
    )
    flags.add(
        "l2-ttl",
        "L2 entry TTL, seconds",
        default=cache_defaults.DEFAULT_L2_TTL_S,
        parse=float,
        group=group,
    )
    flags.add(
        "ttl",
        "seconds after its fill an entry stops being served (L1, L2, L3), for tenants the "
        "operator sets no ttlSeconds for; 0: no limit but --l2-ttl",
        default="0",
        parse=_non_negative,
        group=group,
    )
    flags.add(
        "price-table",
        'JSON file of prices per 1k tokens by model, {"<model>": {"prompt": P, '
        '"completion": C}} ("*" = any model), or that JSON itself: cache hits count what '
        "they saved in it",
        default="",
        parse=_or_empty(prices.price_table_flag, dict),
        group=group,
    )
    flags.add(
        "namespace-header",
        "request header whose value (1-63 of [A-Za-z0-9._-]) partitions the tenant's entries, "
        "e.g. one namespace per knowledge base, each with its own invalidation scope",
        default=cache_defaults.DEFAULT_NAMESPACE_HEADER,
        parse=_header_name,
        group=group,
    )
    flags.add(
        "max-entry-bytes",
        "largest answer stored in L1 (larger ones are passed through)",
        default=cache_defaults.DEFAULT_MAX_ENTRY_BYTES,
        parse=byte_size,
        group=group,
    )
    flags.add(
        "l2-max-entry-bytes",
        "largest answer stored in Redis (larger ones stay in L1 only)",
        default=cache_defaults.DEFAULT_L2_MAX_ENTRY_BYTES,
        parse=byte_size,
        group=group,
    )


def add_semantic_flags(flags: Flags) -> None:
    """The semantic tier (L3, docs/semantic.md)."""
    group = "semantic tier (L3)"
    default = SemanticSettings()
    flags.add(
        "semantic-source",
        "embeddings for the semantic tier (L3): none (L3 off), upstream (the model server's "
        "/v1/embeddings), local[:cpu|cuda] (all-MiniLM-L6-v2, pip install "
        "'cachefleet[semantic]'), hashed (character n-grams, lexical) or a URL",
        default=default.source,
        parse=check_source,
        group=group,
    )
    flags.add(
        "semantic-default-on",
        "L3 on for tenants whose InferenceCache entry does not say (default: opt-in per tenant)",
        is_switch=True,
        group=group,
    )
    flags.add(
        "semantic-threshold",
        "default cosine similarity an L3 hit needs, in (0, 1]",
        default=default.threshold,
        parse=_fraction,
        group=group,
    )
    flags.add(
        "semantic-tenant-bytes",
        "L3 index bytes per tenant (least recently used entries go beyond)",
        default=default.tenant_bytes,
        parse=byte_size,
        group=group,
    )
    flags.add(
        "semantic-embeddings-model",
        "model named in /v1/embeddings requests of the upstream/URL source (default: the "
        "request's model)",
        default="",
        group=group,
    )
    flags.add(
        "semantic-timeout",
        "seconds an L3 lookup waits for its embedding before the request goes upstream "
        "(after 5 failures in a row the source is not asked for 5 s)",
        default=default.timeout_s,
        parse=_positive_float,
        group=group,
    )
    flags.add(
        "semantic-shadow",
        "L3 in shadow mode for tenants whose InferenceCache entry does not say: would-be L3 "
        "hits go upstream and the two answers are compared (docs/semantic.md), none is served",
        is_switch=True,
        group=group,
    )
    flags.add(
        "semantic-shadow-sample",
        "share of would-be L3 hits that shadow mode compares with upstream's answer, in (0, 1]",
        default="1.0",
        parse=_fraction,
        group=group,
    )


def add_identity_flags(flags: Flags) -> None:
    """Who a request's tenant is: the header, trusted peers, API keys, the known tenants."""
    group = "tenants"
    flags.add(
        "tenant-header",
        "request header that names the tenant (believed only from --trusted-proxies, "
        "and never when API keys are configured)",
        default=tenancy_defaults.DEFAULT_TENANT_HEADER,
        group=group,
    )
    flags.add(
        "trusted-proxies",
        "comma-separated CIDRs (e.g. 10.0.0.0/8,127.0.0.1/32) whose --tenant-header is "
        "believed; default none: the header is refused from everyone",
        default="",
        parse=_networks,
        group=group,
    )
    flags.add(
        "default-tenant",
        "tenant for requests that name none (or an unknown one); without it they get 403",
        parse=_optional_tenant,
        group=group,
    )
    flags.add(
        "tenants",
        "comma-separated known tenants (the operator's quotas add to them); empty: any valid name",
        default="",
        parse=_tenants,
        group=group,
    )
    flags.add(
        "api-keys-file",
        "JSON file mapping API keys (Authorization: Bearer), plain or as sha256:<hex>, to "
        "tenants; re-read when it changes; with it the key alone decides the tenant",
        parse=_api_keys_file,
        group=group,
    )


def add_tenancy_flags(flags: Flags) -> None:
    """How many tenants, guests, their lifetime, their classes and their rate limits."""
    group = "tenants"
    flags.add(
        "max-tenants",
        "most tenant partitions in L1, and most tenants with their own metric series beyond "
        'the known ones (the rest are counted as tenant="_other")',
        default=tenancy_defaults.DEFAULT_MAX_TENANTS,
        parse=_positive_int,
        group=group,
    )
    flags.add(
        "guest-share",
        "fraction of L1 (0-0.9) for tenants not named by --tenants, the API keys, the "
        "operator's quotas or --default-tenant; with it such tenants are admitted as guests "
        "instead of being refused, and never take bytes from known tenants",
        default="0",
        parse=_guest_share,
        group=group,
    )
    flags.add(
        "tenant-idle-expiry",
        "seconds without a request after which a tenant's L1 entries, slot and metric series "
        "are dropped (0: never)",
        default=tenancy_defaults.DEFAULT_TENANT_IDLE_EXPIRY_S,
        parse=_non_negative,
        group=group,
    )
    flags.add(
        "admission-fairness-weights",
        "tenant=weight,... : each tenant's share of the Standard queue's releases, in "
        "(0, 1000] (default 1; the InferenceCache's tenants[].fairnessWeight wins)",
        default="",
        parse=flows.parse_weights,
        group=group,
    )
    flags.add(
        "admission-objectives",
        "objective=Class,... : the class a request naming this GIE InferenceObjective "
        "(x-gateway-inference-objective) is lowered to, never raised (the InferenceCache's "
        "spec.objectives add to them)",
        default="",
        parse=classes.parse_objectives,
        group=group,
    )
    flags.add(
        "tenant-limits",
        'JSON file of request and token limits by tenant, {"<tenant>": {"requestsPerMinute": N, '
        '"tokensPerMinute": N, "tokensPerDay": N}}, or that JSON itself; enforced fleet-wide '
        "through Redis (the InferenceCache's tenants[].limits win for the tenants it names)",
        default="",
        parse=_or_empty(limits_flag, dict),
        group=group,
    )
    flags.add(
        "limits-count-hits",
        "cache hits of a rate-limited tenant count as requests (never as tokens)",
        is_switch=True,
        group=group,
    )


def add_admission_flags(flags: Flags) -> None:
    """Class-aware admission when the model server is saturated (docs/admission.md)."""
    group = "admission"
    flags.add(
        "admission",
        "class-aware admission when the model server is saturated (docs/admission.md): "
        "BestEffort misses get 429, Standard ones wait, Guaranteed ones pass; hits always pass",
        is_switch=True,
        group=group,
    )
    for flag, help_text, default, parse in (
        (
            "admission-max-waiting",
            "requests waiting for prefill (vllm:num_requests_waiting) at which the model server "
            "counts as saturated",
            classes.DEFAULT_MAX_WAITING,
            _admission_threshold("max_waiting", float),
        ),
        (
            "admission-max-kv-usage",
            "KV cache usage in (0, 1] at which the model server counts as saturated",
            classes.DEFAULT_MAX_KV_USAGE,
            _admission_threshold("max_kv_usage", float),
        ),
        (
            "admission-max-running",
            "running requests (vllm:num_requests_running) at which the model server counts as "
            "saturated; empty: not a signal",
            "",
            _admission_threshold("max_running", _optional_float),
        ),
        (
            "admission-standard-queue",
            "Standard requests that may wait for room at once (429 beyond)",
            classes.DEFAULT_STANDARD_QUEUE,
            _admission_threshold("standard_queue", int),
        ),
        (
            "admission-standard-max-wait",
            "seconds a Standard request waits for room before it gets 503",
            classes.DEFAULT_STANDARD_MAX_WAIT_S,
            _admission_threshold("standard_max_wait_s", float),
        ),
    ):
        flags.add(flag, help_text, default=default, parse=parse, group=group)
    flags.add(
        "admission-metrics-url",
        "the model server's Prometheus metrics (default: the upstream's /metrics)",
        default="",
        group=group,
    )


def add_adapt_flags(flags: Flags) -> None:
    """Miss-ratio curves, the fleet samples, and policy switching."""
    group = "curves and switching"
    flags.add(
        "switch-window",
        "seconds per window of the P99-driven LIRS -> SITS switching engine; 0: off",
        default=f"{DEFAULT_WINDOW_S:g}",
        parse=_window,
        group=group,
    )
    flags.add(
        "mrc-samples",
        "keys sampled per tenant for its miss-ratio curve (0 turns curves off)",
        default=DEFAULT_MAX_SAMPLES,
        parse=_count,
        group=group,
    )
    flags.add(
        "mrc-max-rate",
        "highest share of a tenant's keys sampled for its curve, in (0, 1]; bounds the "
        "hit path's cost (1 measures small tenants exactly)",
        default=DEFAULT_MAX_RATE,
        parse=_fraction,
        group=group,
    )
    flags.add(
        "fleet-sample-rate",
        "share of the key space whose accesses go, with Redis, to the stream of the "
        "operator's fleet-wide curves, in (0, 1]; the same on every pod of a cache",
        default=repr(FLEET_SAMPLE_RATE),
        parse=_fraction,
        group=group,
    )


def add_observe_flags(flags: Flags) -> None:
    """Who sees tenant names in /status, and where traces go."""
    group = "observability"
    flags.add(
        "status-peers",
        "comma-separated CIDRs whose peers see tenant names in /status (others get counts)",
        default=",".join(DEFAULT_STATUS_PEERS),
        parse=_networks,
        group=group,
    )
    flags.add(
        "otlp-endpoint",
        "OTLP/HTTP collector URL for request traces (http://collector:4318; /v1/traces is "
        "added unless given); the W3C traceparent goes on to the model server. Empty: off",
        default="",
        parse=otlp_url,
        group=group,
    )


def add_control_flags(flags: Flags) -> None:
    """How fresh invalidation epochs must be, and the warm-up of a starting sidecar."""
    group = "invalidation and warm-up"
    flags.add(
        "staleness-bound",
        "seconds without confirmed invalidation epochs after which L1 hits stop",
        default=DEFAULT_STALENESS_BOUND_S,
        parse=float,
        group=group,
    )
    flags.add(
        "redis-outage-staleness",
        "0 (strict): while Redis is unreachable, L1 hits stop after --staleness-bound; "
        "N > 0: they go on for up to N seconds after the last confirmed epochs",
        default="0",
        parse=_non_negative,
        group=group,
    )
    flags.add(
        "warm-bytes",
        "bytes of L1 a starting sidecar fills from L2 (its tenants' most recently used "
        "entries) before /readyz says ready; 0: no warm-up",
        default="0",
        parse=byte_size,
        group=group,
    )
    flags.add(
        "warm-timeout",
        "seconds a warm-up may hold readiness back (a Redis that is down ends it sooner "
        "or at this bound)",
        default=DEFAULT_WARM_TIMEOUT_S,
        parse=_positive_float,
        group=group,
    )


def sidecar_flags(environ: Mapping[str, str] | None = None) -> Flags:
    """Every flag of the sidecar (``environ``: the environment read, default the process's)."""
    flags = Flags("cachefleet sidecar", DESCRIPTION, environ=environ)
    for add_flags in (
        add_process_flags,
        add_http_flags,
        add_limits_flags,
        add_cache_flags,
        add_semantic_flags,
        add_identity_flags,
        add_tenancy_flags,
        add_admission_flags,
        add_adapt_flags,
        add_observe_flags,
        add_control_flags,
    ):
        add_flags(flags)
    return flags


# ---------------------------------------------------------------------- records


def http_settings(ns: argparse.Namespace) -> HttpSettings:
    limits = Limits(
        max_url_bytes=ns.max_url_bytes,
        max_header_bytes=ns.max_header_bytes,
        max_body_bytes=ns.max_body_bytes,
        body_memory_bytes=ns.max_body_memory,
        max_pipelined=ns.max_pipelined,
        idle_timeout_s=ns.idle_timeout,
        header_timeout_s=ns.header_timeout,
        body_timeout_s=ns.body_timeout,
        send_timeout_s=ns.send_timeout,
    )
    return HttpSettings(
        upstream=ns.upstream,
        upstream_timeout_s=ns.upstream_timeout,
        upstream_max_connections=ns.upstream_max_connections,
        upstream_max_queued=ns.upstream_max_queued,
        limits=limits,
    )


def cache_settings(ns: argparse.Namespace) -> CacheSettings:
    return CacheSettings(
        l1_bytes=ns.l1_bytes,
        policy=ns.policy,
        max_entry_bytes=ns.max_entry_bytes,
        l2_ttl_s=ns.l2_ttl,
        l2_max_entry_bytes=ns.l2_max_entry_bytes,
        ttl_s=ns.ttl,
        namespace_header=ns.namespace_header,
        model_version=ns.model_version,
        collapse_whitespace=ns.collapse_whitespace,
        cache_nondeterministic=ns.cache_nondeterministic,
        price_table=ns.price_table,
    )


def semantic_settings(ns: argparse.Namespace) -> SemanticSettings:
    return SemanticSettings(
        source=ns.semantic_source,
        default_on=ns.semantic_default_on,
        threshold=ns.semantic_threshold,
        tenant_bytes=ns.semantic_tenant_bytes,
        embeddings_model=ns.semantic_embeddings_model,
        timeout_s=ns.semantic_timeout,
        shadow=ns.semantic_shadow,
        shadow_sample=ns.semantic_shadow_sample,
    )


def tenancy_settings(ns: argparse.Namespace) -> TenancySettings:
    return TenancySettings(
        tenant_header=ns.tenant_header,
        default_tenant=ns.default_tenant,
        tenants=ns.tenants,
        api_keys_file=ns.api_keys_file,
        trusted_proxies=ns.trusted_proxies,
        guest_share=ns.guest_share,
        max_tenants=ns.max_tenants,
        tenant_idle_expiry_s=ns.tenant_idle_expiry,
        admission_weights=ns.admission_fairness_weights,
        admission_objectives=ns.admission_objectives,
        tenant_limits=ns.tenant_limits,
        limits_count_hits=ns.limits_count_hits,
    )


def adapt_settings(ns: argparse.Namespace) -> AdaptSettings:
    thresholds = None
    if ns.admission:
        thresholds = admission.AdmissionConfig(
            max_waiting=ns.admission_max_waiting,
            max_kv_usage=ns.admission_max_kv_usage,
            max_running=ns.admission_max_running,
            standard_queue=ns.admission_standard_queue,
            standard_max_wait_s=ns.admission_standard_max_wait,
        )
    return AdaptSettings(
        admission=thresholds,
        admission_metrics_url=ns.admission_metrics_url,
        switch_window_s=ns.switch_window,
        mrc_samples=ns.mrc_samples,
        mrc_max_rate=ns.mrc_max_rate,
        fleet_sample_rate=ns.fleet_sample_rate,
    )


def observe_settings(ns: argparse.Namespace) -> ObserveSettings:
    return ObserveSettings(otlp_endpoint=ns.otlp_endpoint, status_peers=ns.status_peers)


def control_settings(ns: argparse.Namespace) -> ControlSettings:
    return ControlSettings(
        staleness_bound_s=ns.staleness_bound,
        redis_outage_staleness_s=ns.redis_outage_staleness,
        warm_bytes=ns.warm_bytes,
        warm_timeout_s=ns.warm_timeout,
    )
