"""``cachefleet router``: flags (each also ``CACHEFLEET_<FLAG>``) -> RouterConfig -> running server.

The flags are declared on the one flag mechanism (:mod:`cachefleet_common.flags`),
one ``add_<group>_flags`` per group: a flag wins over the environment, which wins
over the default, and every value goes through its own parser below. Bad input
exits 2 with a message naming the flag. Exactly one source of endpoints:
``--endpoints``, ``--pool-name``, or ``--selector`` with ``--target-port``.
SIGTERM / SIGINT stop the router cleanly (health NOT_SERVING, streams in flight
finish within the grace).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from cachefleet_common.classes import parse_objectives
from cachefleet_common.flags import Flags
from cachefleet_common.values import byte_size, cache_ref, otlp_url

from .discovery import MAX_METRICS_BYTES, SCRAPE_TIMEOUT_S
from .extproc import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_BODY_MEMORY, DEFAULT_MAX_STREAMS
from .kube import KubeCredentialsError, own_namespace
from .kvsub import KV_EVENTS_MODES
from .profiles import PROFILES
from .scoring import ScoringConfig
from .server import DEFAULT_GRACE_S, RouterConfig, serve
from .tenants import DEFAULT_POLL_S

DEFAULT_GRPC_LISTEN = "0.0.0.0:9002"
DEFAULT_METRICS_LISTEN = "0.0.0.0:9090"
DEFAULT_SCRAPE_INTERVAL_S = 0.5

_LABEL_KEY_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./")

T = TypeVar("T")


def host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port); ValueError says what is wrong."""
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host = host.strip("[]")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"port must be 0..65535, got {port!r} in {value!r}")
    return host, int(port)


def endpoint_list(value: str) -> tuple[str, ...]:
    out: list[str] = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        host, port = host_port(item)
        if port == 0:
            raise ValueError(f"an endpoint needs a real port, got {item!r}")
        out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if not out:
        raise ValueError("no endpoint given")
    return tuple(dict.fromkeys(out))


def label_selector(value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not sep or not key or not set(key) <= _LABEL_KEY_CHARS or "=" in val:
            raise ValueError(f"expected key=value pairs separated by commas, got {item!r}")
        out[key] = val
    if not out:
        raise ValueError("an empty selector would select nothing")
    return out


def _blank_is_none(parse: Callable[[str], T]) -> Callable[[str], T | None]:
    """An optional flag's parser: empty text (an empty environment variable) is no value."""

    def parse_optional(value: str) -> T | None:
        return parse(value) if value.strip() else None

    return parse_optional


def seconds(value: str) -> float:
    """A positive number of seconds (``inf`` allowed: never)."""
    number = float(value)
    if number <= 0 or number != number:
        raise ValueError(f"expected a positive number of seconds, got {value!r}")
    return number


def seconds_or_zero(value: str) -> float:
    number = float(value)
    if number < 0 or number != number:
        raise ValueError(f"expected a positive number of seconds, got {value!r}")
    return number


def finite_number(value: str) -> float:
    number = float(value)
    if not (number >= 0 and number != float("inf")):
        raise ValueError(f"expected a finite number >= 0, got {value!r}")
    return number


def positive_number(value: str) -> float:
    number = finite_number(value)
    if number == 0:
        raise ValueError(f"expected a number > 0, got {value!r}")
    return number


def positive_count(value: str) -> int:
    """A whole number > 0; binary units allowed (``4Mi``: the byte bounds are counts too)."""
    try:
        number = byte_size(value)
    except ValueError:
        raise ValueError(f"expected a count such as 4194304 or 4Mi, got {value!r}") from None
    if number < 1:
        raise ValueError(f"expected a count > 0, got {value!r}")
    return number


def target_port(value: str) -> int:
    port = int(value)
    if not 1 <= port <= 65535:
        raise ValueError(f"expected 1..65535, got {value!r}")
    return port


def listen_or_off(value: str) -> tuple[str, int] | None:
    """``HOST:PORT``, or ``off`` (also ``none`` or nothing): no listener."""
    return None if value.lower() in {"off", "none", ""} else host_port(value)


def redis_url(value: str) -> str:
    if not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"expected redis://, rediss:// or unix://, got {value!r}")
    return value


def log_level(value: str) -> str:
    level = value.lower()
    if level not in {"debug", "info", "warning", "error"}:
        raise ValueError(f"expected debug, info, warning or error, got {value!r}")
    return level


def tenant_header(value: str) -> str:
    name = value.strip()
    if not name or " " in name:
        raise ValueError(f"not a header name: {value!r}")
    return name


def session_header(value: str) -> str:
    name = value.strip()
    if " " in name or ":" in name:
        raise ValueError(f"not a header name: {value!r}")
    return name


def profile_name(value: str) -> str:
    if value not in PROFILES:
        raise ValueError(f"expected one of {', '.join(PROFILES)}, got {value!r}")
    return value


def kv_events_mode(value: str) -> str:
    if value not in KV_EVENTS_MODES:
        raise ValueError(f"expected off or auto, got {value!r}")
    return value


def zmq_listen(value: str) -> str:
    """``tcp://HOST:PORT`` the router binds for KV events."""
    address = value.strip()
    if not address.startswith("tcp://"):
        raise ValueError(f"expected tcp://HOST:PORT, got {address!r}")
    host_port(address[len("tcp://") :])
    return address


def tokenizer_source(value: str) -> str:
    if value.startswith("local:"):
        path = value[len("local:") :]
        if not (Path(path) / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in {path!r}")
    elif value not in ("auto", "approx"):
        raise ValueError(f"expected auto, approx or local:PATH, got {value!r}")
    return value


def add_serving_flags(flags: Flags) -> None:
    """Where the router listens, how it logs and traces, how it stops."""
    group = "Serving"
    flags.add(
        "grpc-listen",
        "HOST:PORT of ext_proc and grpc.health.v1",
        default=DEFAULT_GRPC_LISTEN,
        parse=host_port,
        group=group,
    )
    flags.add(
        "metrics-listen",
        "HOST:PORT of /metrics, /healthz, /readyz ('off': none)",
        default=DEFAULT_METRICS_LISTEN,
        parse=listen_or_off,
        group=group,
    )
    flags.add(
        "shutdown-grace",
        "seconds streams in flight get at shutdown",
        default=DEFAULT_GRACE_S,
        parse=seconds_or_zero,
        group=group,
    )
    flags.add(
        "log-level", "debug | info | warning | error", default="info", parse=log_level, group=group
    )
    flags.add(
        "otlp-endpoint",
        "OTLP/HTTP collector URL for the picks' spans (http://collector:4318; /v1/traces is "
        "added unless given); the answer sets the next hop's traceparent. Empty: off",
        default="",
        parse=otlp_url,
        group=group,
    )


def add_endpoint_flags(flags: Flags) -> None:
    """Where the model servers come from (exactly one source) and how they are read."""
    group = "Endpoints"
    flags.add(
        "endpoints",
        "static endpoints HOST:PORT,... (their /metrics on the same address)",
        parse=_blank_is_none(endpoint_list),
        group=group,
    )
    flags.add(
        "pool-name",
        "watch this InferencePool (inference.networking.k8s.io/v1) in --namespace",
        parse=_blank_is_none(str),
        group=group,
    )
    flags.add(
        "selector",
        "watch pods with these labels k=v,... (needs --target-port)",
        parse=_blank_is_none(label_selector),
        group=group,
    )
    flags.add(
        "target-port",
        "the model server's port on the --selector pods",
        parse=_blank_is_none(target_port),
        group=group,
    )
    flags.add(
        "namespace",
        "namespace of the pool or pods (default: the pod's own, else 'default')",
        parse=_blank_is_none(str),
        group=group,
    )
    flags.add(
        "kubeconfig",
        "kubeconfig file (default: in-cluster, else $KUBECONFIG / ~/.kube/config)",
        parse=_blank_is_none(str),
        group=group,
    )
    flags.add(
        "scrape-interval",
        "seconds between reads of each endpoint's /metrics; an endpoint is out after two "
        "failed reads in a row (0: no reads, every member is ready)",
        default=DEFAULT_SCRAPE_INTERVAL_S,
        parse=seconds_or_zero,
        group=group,
    )


def add_tenant_flags(flags: Flags) -> None:
    """The operator's quota table (tenants, priority classes) and the request's class."""
    group = "Tenants and classes"
    flags.add(
        "redis-url",
        "Redis holding the operator's quota table (tenants and priority classes)",
        parse=_blank_is_none(redis_url),
        group=group,
    )
    flags.add(
        "cache",
        "NAMESPACE/NAME of the InferenceCache whose tenants to read (with --redis-url)",
        parse=_blank_is_none(cache_ref),
        group=group,
    )
    flags.add(
        "tenant-poll",
        "seconds between reads of the quota table without a control message",
        default=DEFAULT_POLL_S,
        parse=seconds,
        group=group,
    )
    flags.add(
        "tenant-header",
        "request header naming the tenant",
        default="X-Tenant-ID",
        parse=tenant_header,
        group=group,
    )
    flags.add(
        "objectives",
        "objective=Class,... : the class a request naming this GIE InferenceObjective "
        "(x-gateway-inference-objective) is lowered to, never raised (the quota table's "
        "spec.objectives add to them)",
        default="",
        parse=parse_objectives,
        group=group,
    )


def add_scoring_flags(flags: Flags) -> None:
    """The picker: its profile, what it knows of the servers' caches, and its scoring."""
    group = "Scoring"
    scoring = ScoringConfig()
    flags.add(
        "profile",
        f"scheduling profile: {' | '.join(PROFILES)}",
        default="default",
        parse=profile_name,
        group=group,
    )
    flags.add(
        "default-prefill-rate",
        "uncached prompt tokens/s an endpoint is assumed to prefill until its metrics measure it",
        default=scoring.default_rate,
        parse=positive_number,
        group=group,
    )
    flags.add(
        "epsilon",
        "bounded load: no endpoint is chosen above (1 + epsilon) x the mean outstanding work",
        default=scoring.epsilon,
        parse=finite_number,
        group=group,
    )
    flags.add(
        "kv-events",
        "off | auto: subscribe to each endpoint's KV-cache events (ZMQ; found with GET "
        "/kv_event_sources) and route on what the servers say they hold",
        default="auto",
        parse=kv_events_mode,
        group=group,
    )
    flags.add(
        "kv-events-listen",
        "tcp://HOST:PORT the router binds for servers that publish their KV events to one "
        "address (topics kv@<pod address>@<model>)",
        parse=_blank_is_none(zmq_listen),
        group=group,
    )
    flags.add(
        "tokenizer",
        "auto (the endpoints' POST /tokenize) | approx (characters / 4) | local:PATH "
        "(a tokenizer.json and chat template)",
        default="auto",
        parse=tokenizer_source,
        group=group,
    )


def add_affinity_flags(flags: Flags) -> None:
    """Sessions and LoRA adapters (docs/routing.md "Affinity: LoRA adapters and sessions")."""
    group = "Affinity"
    scoring = ScoringConfig()
    flags.add(
        "session-header",
        "request header naming a session: its requests stay on one endpoint while that is "
        "under the bounded-load cap (default: none)",
        parse=_blank_is_none(session_header),
        group=group,
    )
    flags.add(
        "session-ttl",
        "seconds after which a session not seen starts afresh",
        default=scoring.session_ttl_s,
        parse=seconds,
        group=group,
    )
    flags.add(
        "lora-load-seconds",
        "seconds one LoRA adapter load costs an endpoint that must load the request's adapter",
        default=scoring.lora_load_s,
        parse=finite_number,
        group=group,
    )


def add_limit_flags(flags: Flags) -> None:
    """Bounds against hostile model servers and gateways."""
    group = "Limits"
    flags.add(
        "scrape-timeout",
        "seconds one /metrics reading may take, all of it (a slower one is a failed reading)",
        default=SCRAPE_TIMEOUT_S,
        parse=seconds,
        group=group,
    )
    flags.add(
        "max-metrics-bytes",
        "largest /metrics answer read (e.g. 4Mi); a longer one is a failed reading",
        default=MAX_METRICS_BYTES,
        parse=positive_count,
        group=group,
    )
    flags.add(
        "max-body-bytes",
        "request body bytes read for routing; past them the request is routed by load",
        default=DEFAULT_MAX_BODY_BYTES,
        parse=positive_count,
        group=group,
    )
    flags.add(
        "max-body-memory",
        "request body bytes held at once across all streams; past them a request is routed "
        "by load on what was read",
        default=DEFAULT_MAX_BODY_MEMORY,
        parse=positive_count,
        group=group,
    )
    flags.add(
        "max-streams",
        "ext_proc streams (requests through the gateway) open at once; one more gets a 503",
        default=DEFAULT_MAX_STREAMS,
        parse=positive_count,
        group=group,
    )


def add_gateway_flags(flags: Flags) -> None:
    """What the gateway gets when no endpoint is ready; GIE's conformance hooks."""
    group = "Gateway"
    flags.add(
        "fail-open",
        "no ready endpoint (or the stream cap): end the ext_proc stream with gRPC "
        "UNAVAILABLE so the gateway (InferencePool failureMode: FailOpen) picks an endpoint "
        "itself, while it still can (no body message yet; a 503 after)",
        is_switch=True,
        group=group,
        exclusive="failure mode",
    )
    # --fail-closed is the default's name, so it has no environment form; given with
    # --fail-open, argparse refuses the pair (exit 2).
    flags.add(
        "fail-closed",
        "no ready endpoint: answer 503 Service Unavailable (ImmediateResponse), "
        "the protocol's answer (default)",
        is_switch=True,
        env=False,
        group=group,
        exclusive="failure mode",
    )
    flags.add(
        "conformance",
        "GIE's conformance hooks: the test-epp-endpoint-selection request header picks "
        "among the endpoints it names, x-conformance-test-served-endpoint reports the served "
        "one; any client could steer its request: for test clusters only",
        is_switch=True,
        group=group,
    )


def build_flags() -> Flags:
    """Every flag of ``cachefleet router``, group by group."""
    flags = Flags(
        "cachefleet router",
        "Endpoint picker for the Gateway API Inference Extension (Envoy ext_proc "
        "over gRPC): sends each request to the ready model server with the least expected "
        "time to first token. Every flag can also be set as CACHEFLEET_<FLAG>.",
    )
    add_serving_flags(flags)
    add_endpoint_flags(flags)
    add_tenant_flags(flags)
    add_scoring_flags(flags)
    add_affinity_flags(flags)
    add_limit_flags(flags)
    add_gateway_flags(flags)
    return flags


def _check_together(flags: Flags, ns: argparse.Namespace) -> None:
    """The rules between flags: one source of endpoints, and flags that come in pairs."""
    sources = [f for f in ("endpoints", "pool-name", "selector") if getattr(ns, _dest(f))]
    if len(sources) != 1:
        flags.error(
            "give exactly one of --endpoints, --pool-name, --selector"
            + (f" (got {', '.join('--' + s for s in sources)})" if sources else "")
        )
    if ns.selector and ns.target_port is None:
        flags.error("--selector needs --target-port (the model server's port)")
    if ns.target_port is not None and not ns.selector:
        flags.error("--target-port goes with --selector (an InferencePool names its ports)")
    if ns.kubeconfig and ns.endpoints:
        flags.error("--kubeconfig is for --pool-name / --selector, not --endpoints")
    if bool(ns.redis_url) != bool(ns.cache):
        flags.error("--redis-url and --cache go together (the quota table of one cache)")


def parse_args(argv: list[str]) -> tuple[RouterConfig, str]:
    """Flags (and environment) -> (config, log level); exits 2 naming the bad flag."""
    flags = build_flags()
    ns = flags.parse(argv)
    _check_together(flags, ns)
    config = RouterConfig(
        grpc_listen=ns.grpc_listen,
        metrics_listen=ns.metrics_listen,
        endpoints=ns.endpoints or (),
        pool_name=ns.pool_name,
        selector=ns.selector or {},
        target_ports=() if ns.target_port is None else (ns.target_port,),
        namespace=ns.namespace or own_namespace() or "default",
        kubeconfig=ns.kubeconfig,
        scrape_interval_s=ns.scrape_interval,
        redis_url=ns.redis_url,
        cache=ns.cache,
        tenant_poll_s=ns.tenant_poll,
        tenant_header=ns.tenant_header,
        objectives=ns.objectives,
        fail_open=ns.fail_open and not ns.fail_closed,
        grace_s=ns.shutdown_grace,
        default_prefill_rate=ns.default_prefill_rate,
        epsilon=ns.epsilon,
        scrape_timeout_s=ns.scrape_timeout,
        max_metrics_bytes=ns.max_metrics_bytes,
        max_body_bytes=ns.max_body_bytes,
        max_body_memory=ns.max_body_memory,
        max_streams=ns.max_streams,
        conformance=ns.conformance,
        profile=ns.profile,
        kv_events=ns.kv_events,
        kv_events_listen=ns.kv_events_listen,
        tokenizer=ns.tokenizer,
        otlp_endpoint=ns.otlp_endpoint,
        session_header=ns.session_header,
        session_ttl_s=ns.session_ttl,
        lora_load_s=ns.lora_load_seconds,
    )
    return config, ns.log_level


def _dest(flag: str) -> str:
    return flag.replace("-", "_")


async def _run(config: RouterConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(config, stop)


def main(argv: list[str] | None = None) -> int:
    import sys

    config, level = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(_run(config))
    except KubeCredentialsError as exc:
        print(f"cachefleet router: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"cachefleet router: {exc}", file=sys.stderr)
        return 1
    return 0
