"""``cachefleet router``: flags (each also ``CACHEFLEET_<FLAG>``) -> RouterConfig -> running server.

Flags win over the environment. Bad input exits 2 with a message naming the
flag. Exactly one source of endpoints: ``--endpoints``, ``--pool-name``, or
``--selector`` with ``--target-port``. SIGTERM / SIGINT stop the router
cleanly (health NOT_SERVING, streams in flight finish within the grace).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any

from cachefleet_common.classes import parse_objectives

from .discovery import MAX_METRICS_BYTES, SCRAPE_TIMEOUT_S
from .extproc import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_BODY_MEMORY, DEFAULT_MAX_STREAMS
from .kube import KubeCredentialsError, own_namespace
from .kvsub import KV_EVENTS_MODES
from .profiles import PROFILES
from .scoring import ScoringConfig
from .server import DEFAULT_GRACE_S, RouterConfig, serve
from .tenants import DEFAULT_POLL_S

ENV_PREFIX = "CACHEFLEET_"
DEFAULT_GRPC_LISTEN = "0.0.0.0:9002"
DEFAULT_METRICS_LISTEN = "0.0.0.0:9090"
DEFAULT_SCRAPE_INTERVAL_S = 0.5

_LABEL_KEY_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./")


def _env(flag: str) -> str | None:
    return os.environ.get(ENV_PREFIX + flag.upper().replace("-", "_"))


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


def byte_count(value: str) -> int:
    """``4194304``, ``4Mi`` or ``4M`` (binary units: Ki, Mi, Gi) -> a number."""
    units = {"k": 1024, "m": 1024**2, "g": 1024**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}
    text = value.strip().lower().removesuffix("b")
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix) and text[: -len(suffix)].isdigit():
            return int(text[: -len(suffix)]) * units[suffix]
    if text.isdigit():
        return int(text)
    raise ValueError(f"expected a count such as 4194304 or 4Mi, got {value!r}")


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cachefleet router",
        description="Endpoint picker for the Gateway API Inference Extension (Envoy ext_proc "
        "over gRPC): sends each request to the ready model server with the least expected "
        "time to first token. Every flag can also be set as CACHEFLEET_<FLAG>.",
    )

    def add(flag: str, help_text: str, **kw: Any) -> None:
        env = _env(flag)
        if env is not None:
            kw["default"] = env
        p.add_argument(
            f"--{flag}",
            help=f"{help_text} [env {ENV_PREFIX}{flag.upper().replace('-', '_')}]",
            **kw,
        )

    add("grpc-listen", "HOST:PORT of ext_proc and grpc.health.v1", default=DEFAULT_GRPC_LISTEN)
    add(
        "metrics-listen",
        "HOST:PORT of /metrics, /healthz, /readyz ('off': none)",
        default=DEFAULT_METRICS_LISTEN,
    )
    add("endpoints", "static endpoints HOST:PORT,... (their /metrics on the same address)")
    add("pool-name", "watch this InferencePool (inference.networking.k8s.io/v1) in --namespace")
    add("selector", "watch pods with these labels k=v,... (needs --target-port)")
    add("target-port", "the model server's port on the --selector pods")
    add("namespace", "namespace of the pool or pods (default: the pod's own, else 'default')")
    add("kubeconfig", "kubeconfig file (default: in-cluster, else $KUBECONFIG / ~/.kube/config)")
    add(
        "scrape-interval",
        "seconds between reads of each endpoint's /metrics; an endpoint is out after two "
        "failed reads in a row (0: no reads, every member is ready)",
        default=str(DEFAULT_SCRAPE_INTERVAL_S),
    )
    add("redis-url", "Redis holding the operator's quota table (tenants and priority classes)")
    add("cache", "NAMESPACE/NAME of the InferenceCache whose tenants to read (with --redis-url)")
    add(
        "tenant-poll",
        "seconds between reads of the quota table without a control message",
        default=str(DEFAULT_POLL_S),
    )
    add("tenant-header", "request header naming the tenant", default="X-Tenant-ID")
    add(
        "objectives",
        "objective=Class,... : the class a request naming this GIE InferenceObjective "
        "(x-gateway-inference-objective) is lowered to, never raised (the quota table's "
        "spec.objectives add to them)",
        default="",
    )
    add(
        "shutdown-grace",
        "seconds streams in flight get at shutdown",
        default=str(DEFAULT_GRACE_S),
    )
    add(
        "default-prefill-rate",
        "uncached prompt tokens/s an endpoint is assumed to prefill until its metrics measure it",
        default=str(ScoringConfig().default_rate),
    )
    add(
        "epsilon",
        "bounded load: no endpoint is chosen above (1 + epsilon) x the mean outstanding work",
        default=str(ScoringConfig().epsilon),
    )
    add("log-level", "debug | info | warning | error", default="info")
    # -- hostile model servers and gateways (limits; GIE conformance hooks) ----------------
    add(
        "scrape-timeout",
        "seconds one /metrics reading may take, all of it (a slower one is a failed reading)",
        default=str(SCRAPE_TIMEOUT_S),
    )
    add(
        "max-metrics-bytes",
        "largest /metrics answer read (e.g. 4Mi); a longer one is a failed reading",
        default=str(MAX_METRICS_BYTES),
    )
    add(
        "max-body-bytes",
        "request body bytes read for routing; past them the request is routed by load",
        default=str(DEFAULT_MAX_BODY_BYTES),
    )
    add(
        "max-body-memory",
        "request body bytes held at once across all streams; past them a request is routed "
        "by load on what was read",
        default=str(DEFAULT_MAX_BODY_MEMORY),
    )
    add(
        "max-streams",
        "ext_proc streams (requests through the gateway) open at once; one more gets a 503",
        default=str(DEFAULT_MAX_STREAMS),
    )
    add(
        "otlp-endpoint",
        "OTLP/HTTP collector URL for the picks' spans (http://collector:4318; /v1/traces is "
        "added unless given); the answer sets the next hop's traceparent. Empty: off",
        default="",
    )
    env_conformance = (_env("conformance") or "").lower() in {"1", "true", "yes"}
    p.add_argument(
        "--conformance",
        action="store_true",
        default=env_conformance,
        help="GIE's conformance hooks: the test-epp-endpoint-selection request header picks "
        "among the endpoints it names, x-conformance-test-served-endpoint reports the served "
        f"one; any client could steer its request: for test clusters only "
        f"[env {ENV_PREFIX}CONFORMANCE=true]",
    )
    # -- precise routing (issue 35; docs/router.md "Profiles, KV events, tokenizer") --
    add("profile", f"scheduling profile: {' | '.join(PROFILES)}", default="default")
    add(
        "kv-events",
        "off | auto: subscribe to each endpoint's KV-cache events (ZMQ; found with GET "
        "/kv_event_sources) and route on what the servers say they hold",
        default="auto",
    )
    add(
        "kv-events-listen",
        "tcp://HOST:PORT the router binds for servers that publish their KV events to one "
        "address (topics kv@<pod address>@<model>)",
    )
    add(
        "tokenizer",
        "auto (the endpoints' POST /tokenize) | approx (characters / 4) | local:PATH "
        "(a tokenizer.json and chat template)",
        default="auto",
    )
    # -- affinity (issue 35.6; docs/routing.md "Affinity: LoRA adapters and sessions") --
    add(
        "session-header",
        "request header naming a session: its requests stay on one endpoint while that is "
        "under the bounded-load cap (default: none)",
    )
    add(
        "session-ttl",
        "seconds after which a session not seen starts afresh",
        default=str(ScoringConfig().session_ttl_s),
    )
    add(
        "lora-load-seconds",
        "seconds one LoRA adapter load costs an endpoint that must load the request's adapter",
        default=str(ScoringConfig().lora_load_s),
    )
    fail = p.add_mutually_exclusive_group()
    env_fail = (_env("fail-open") or "").lower() in {"1", "true", "yes"}
    fail.add_argument(
        "--fail-open",
        dest="fail_open",
        action="store_true",
        default=env_fail,
        help="no ready endpoint (or the stream cap): end the ext_proc stream with gRPC "
        "UNAVAILABLE so the gateway (InferencePool failureMode: FailOpen) picks an endpoint "
        "itself, while it still can (no body message yet; a 503 after) "
        f"[env {ENV_PREFIX}FAIL_OPEN=true]",
    )
    fail.add_argument(
        "--fail-closed",
        dest="fail_open",
        action="store_false",
        help="no ready endpoint: answer 503 Service Unavailable (ImmediateResponse), "
        "the protocol's answer (default)",
    )
    return p


def parse_args(argv: list[str]) -> tuple[RouterConfig, str]:
    """Flags (and environment) -> (config, log level); exits 2 naming the bad flag."""
    parser = build_parser()
    ns = parser.parse_args(argv)

    def conv(flag: str, value: Any, fn: Any) -> Any:
        try:
            return fn(value)
        except ValueError as exc:
            parser.error(f"--{flag}: {exc}")

    def seconds(flag: str, value: Any, *, zero_ok: bool = False) -> float:
        number = float(conv(flag, value, float))
        if number < 0 or (number == 0 and not zero_ok) or number != number:
            parser.error(f"--{flag}: expected a positive number of seconds, got {value!r}")
        return number

    def number(flag: str, value: Any) -> float:
        out = float(conv(flag, value, float))
        if not (out >= 0 and out != float("inf")):
            parser.error(f"--{flag}: expected a finite number >= 0, got {value!r}")
        return out

    def positive(flag: str, value: Any) -> float:
        out = number(flag, value)
        if out == 0:
            parser.error(f"--{flag}: expected a number > 0, got {value!r}")
        return out

    def count(flag: str, value: Any) -> int:
        out = int(conv(flag, value, byte_count))
        if out < 1:
            parser.error(f"--{flag}: expected a count > 0, got {value!r}")
        return out

    sources = [
        f for f in ("endpoints", "pool-name", "selector") if getattr(ns, f.replace("-", "_"))
    ]
    if len(sources) != 1:
        parser.error(
            "give exactly one of --endpoints, --pool-name, --selector"
            + (f" (got {', '.join('--' + s for s in sources)})" if sources else "")
        )
    endpoints: tuple[str, ...] = ()
    selector: dict[str, str] = {}
    ports: tuple[int, ...] = ()
    if ns.endpoints:
        endpoints = conv("endpoints", ns.endpoints, endpoint_list)
    if ns.selector:
        selector = conv("selector", ns.selector, label_selector)
        if not ns.target_port:
            parser.error("--selector needs --target-port (the model server's port)")
    if ns.target_port:
        if not ns.selector:
            parser.error("--target-port goes with --selector (an InferencePool names its ports)")
        port = conv("target-port", ns.target_port, int)
        if not 1 <= port <= 65535:
            parser.error(f"--target-port: expected 1..65535, got {ns.target_port!r}")
        ports = (port,)
    if ns.kubeconfig and ns.endpoints:
        parser.error("--kubeconfig is for --pool-name / --selector, not --endpoints")
    if bool(ns.redis_url) != bool(ns.cache):
        parser.error("--redis-url and --cache go together (the quota table of one cache)")
    cache = None
    if ns.cache:
        namespace_, sep, name = str(ns.cache).partition("/")
        if not sep or not namespace_ or not name or "/" in name:
            parser.error(f"--cache: expected NAMESPACE/NAME, got {ns.cache!r}")
        cache = f"{namespace_}/{name}"
    if ns.redis_url and not str(ns.redis_url).startswith(("redis://", "rediss://", "unix://")):
        parser.error(f"--redis-url: expected redis://, rediss:// or unix://, got {ns.redis_url!r}")
    metrics_listen = None
    if str(ns.metrics_listen).lower() not in {"off", "none", ""}:
        metrics_listen = conv("metrics-listen", ns.metrics_listen, host_port)
    level = str(ns.log_level).lower()
    if level not in {"debug", "info", "warning", "error"}:
        parser.error(f"--log-level: expected debug, info, warning or error, got {ns.log_level!r}")
    if not str(ns.tenant_header).strip() or " " in str(ns.tenant_header).strip():
        parser.error(f"--tenant-header: not a header name: {ns.tenant_header!r}")
    # precise routing (issue 35)
    if ns.profile not in PROFILES:
        parser.error(f"--profile: expected one of {', '.join(PROFILES)}, got {ns.profile!r}")
    if ns.kv_events not in KV_EVENTS_MODES:
        parser.error(f"--kv-events: expected off or auto, got {ns.kv_events!r}")
    kv_listen = str(ns.kv_events_listen or "").strip() or None
    if kv_listen is not None:
        if not kv_listen.startswith("tcp://"):
            parser.error(f"--kv-events-listen: expected tcp://HOST:PORT, got {kv_listen!r}")
        conv("kv-events-listen", kv_listen[len("tcp://") :], host_port)
    tokenizer = str(ns.tokenizer)
    if tokenizer.startswith("local:"):
        if not (Path(tokenizer[len("local:") :]) / "tokenizer.json").is_file():
            parser.error(f"--tokenizer: no tokenizer.json in {tokenizer[len('local:') :]!r}")
    elif tokenizer not in ("auto", "approx"):
        parser.error(f"--tokenizer: expected auto, approx or local:PATH, got {tokenizer!r}")
    otlp = str(ns.otlp_endpoint or "").strip()
    if otlp and not otlp.startswith(("http://", "https://")):
        parser.error(f"--otlp-endpoint: expected an http:// or https:// URL, got {otlp!r}")
    session_header = str(ns.session_header or "").strip() or None
    if session_header is not None and (" " in session_header or ":" in session_header):
        parser.error(f"--session-header: not a header name: {ns.session_header!r}")
    config = RouterConfig(
        grpc_listen=conv("grpc-listen", ns.grpc_listen, host_port),
        metrics_listen=metrics_listen,
        endpoints=endpoints,
        pool_name=ns.pool_name or None,
        selector=selector,
        target_ports=ports,
        namespace=ns.namespace or own_namespace() or "default",
        kubeconfig=ns.kubeconfig or None,
        scrape_interval_s=seconds("scrape-interval", ns.scrape_interval, zero_ok=True),
        redis_url=ns.redis_url or None,
        cache=cache,
        tenant_poll_s=seconds("tenant-poll", ns.tenant_poll),
        tenant_header=str(ns.tenant_header).strip(),
        objectives=conv("objectives", ns.objectives, parse_objectives),
        fail_open=bool(ns.fail_open),
        grace_s=seconds("shutdown-grace", ns.shutdown_grace, zero_ok=True),
        default_prefill_rate=positive("default-prefill-rate", ns.default_prefill_rate),
        epsilon=number("epsilon", ns.epsilon),
        scrape_timeout_s=seconds("scrape-timeout", ns.scrape_timeout),
        max_metrics_bytes=count("max-metrics-bytes", ns.max_metrics_bytes),
        max_body_bytes=count("max-body-bytes", ns.max_body_bytes),
        max_body_memory=count("max-body-memory", ns.max_body_memory),
        max_streams=count("max-streams", ns.max_streams),
        conformance=bool(ns.conformance),
        profile=ns.profile,
        kv_events=ns.kv_events,
        kv_events_listen=kv_listen,
        tokenizer=tokenizer,
        otlp_endpoint=otlp,
        session_header=session_header,
        session_ttl_s=seconds("session-ttl", ns.session_ttl),
        lora_load_s=number("lora-load-seconds", ns.lora_load_seconds),
    )
    return config, level


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
