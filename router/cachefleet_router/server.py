"""The running router: the gRPC server, the metrics HTTP server and the background loops.

:class:`RouterServer` wires the rooms together from a :class:`RouterConfig`:

* one ``grpc.aio`` server on ``grpc_listen`` with the ext_proc service
  (:mod:`cachefleet_router.extproc`) and ``grpc.health.v1``
  (:mod:`cachefleet_router.health`);
* an aiohttp server on ``metrics_listen``: ``/metrics`` (Prometheus text),
  ``/healthz`` (200 while the process runs) and ``/readyz`` (200 once
  discovery has said what the endpoints are, even none: an empty pool is
  answered with the protocol's 503, which is better than an unready picker);
* the picker: the ``profile``'s (:mod:`cachefleet_router.profiles`; the default:
  :class:`~cachefleet_router.scoring.ScoringPicker`, least expected time to first
  token) unless one is given; with ``kv_events`` on, a
  :class:`~cachefleet_router.kvindex.KvIndex` fed by a
  :class:`~cachefleet_router.kvsub.KvEventSubscriber`, and the ``tokenizer``'s
  :class:`~cachefleet_router.tokens.Tokenization` in the ext_proc service;
* discovery (static list + :class:`~cachefleet_router.discovery.MetricsScraper`,
  or :class:`~cachefleet_router.discovery.KubeDiscovery`) and, with Redis,
  :class:`~cachefleet_router.tenants.TenantSync`.

:meth:`RouterServer.stop` reports NOT_SERVING, lets streams in flight finish
within the grace period, then cancels the loops and closes the clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import httpx
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .discovery import (
    MAX_METRICS_BYTES,
    SCRAPE_TIMEOUT_S,
    EndpointPool,
    KubeDiscovery,
    MetricsScraper,
)
from .endpoints import Picker
from .extproc import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BODY_MEMORY,
    DEFAULT_MAX_STREAMS,
    MAX_MESSAGE_BYTES,
    EndpointPickerService,
)
from .health import HealthService
from .kube import make_client
from .kvindex import KvIndex
from .kvsub import KvEventSubscriber
from .metrics import RouterMetrics
from .profiles import build as build_profile
from .scoring import ScoringConfig
from .tenants import DEFAULT_POLL_S, TenantClasses, TenantSync
from .tokens import Tokenization, make_tokenization

if TYPE_CHECKING:
    from .tracing import PickTracer

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 5.0
#: the scoring picker's defaults
_SCORING = ScoringConfig()


@dataclass(frozen=True)
class RouterConfig:
    grpc_listen: tuple[str, int] = ("0.0.0.0", 9002)
    metrics_listen: tuple[str, int] | None = ("0.0.0.0", 9090)
    endpoints: tuple[str, ...] = ()
    pool_name: str | None = None
    selector: dict[str, str] = field(default_factory=dict)
    target_ports: tuple[int, ...] = ()
    namespace: str = "default"
    kubeconfig: str | None = None
    #: seconds between /metrics reads; 0: no reads, members are ready as they come
    scrape_interval_s: float = 0.5
    redis_url: str | None = None
    cache: str | None = None
    tenant_poll_s: float = DEFAULT_POLL_S
    tenant_header: str = "X-Tenant-ID"
    #: GIE objective name -> the class it lowers a request to (the quota table's add to them)
    objectives: dict[str, str] = field(default_factory=dict)
    fail_open: bool = False
    grace_s: float = DEFAULT_GRACE_S
    #: the scoring picker's prefill rate of an endpoint not measured yet, tokens/s
    default_prefill_rate: float = _SCORING.default_rate
    #: the scoring picker's bounded-load parameter
    epsilon: float = _SCORING.epsilon
    # -- hostile model servers and gateways (limits; GIE conformance hooks) ----------------
    #: one /metrics reading, all of it, seconds; and its largest answer, bytes
    scrape_timeout_s: float = SCRAPE_TIMEOUT_S
    max_metrics_bytes: int = MAX_METRICS_BYTES
    #: one request's body read for routing; all bodies held across streams; streams open
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_body_memory: int = DEFAULT_MAX_BODY_MEMORY
    max_streams: int = DEFAULT_MAX_STREAMS
    #: GIE's conformance hooks (a client could steer its request: tests only)
    conformance: bool = False
    # -- precise routing (issue 35; docs/router.md "Profiles, KV events, tokenizer") --
    #: the scheduling profile (cachefleet_router.profiles.PROFILES)
    profile: str = "default"
    #: "auto": subscribe to each endpoint's KV events (GET /kv_event_sources); "off": none
    kv_events: str = "auto"
    #: a ZMQ address the router binds for servers that publish to one place (None: none)
    kv_events_listen: str | None = None
    #: "auto" (the endpoints' /tokenize), "approx" (characters / 4), "local:PATH"
    tokenizer: str = "auto"
    #: OTLP/HTTP collector for the picks' spans (docs/tracing.md); empty: no tracing
    otlp_endpoint: str = ""
    # -- affinity (issue 35.6; docs/routing.md "Affinity: LoRA adapters and sessions") --
    #: the request header naming a session (None: no session affinity)
    session_header: str | None = None
    session_ttl_s: float = _SCORING.session_ttl_s
    #: seconds one LoRA adapter load costs in the default profile
    lora_load_s: float = _SCORING.lora_load_s

    def scoring(self) -> ScoringConfig:
        """The scoring picker's parameters; metrics count as fresh for four scrape periods."""
        stale = max(_SCORING.stale_after_s, 4 * self.scrape_interval_s)
        return ScoringConfig(
            default_rate=self.default_prefill_rate,
            epsilon=self.epsilon,
            stale_after_s=stale,
            session_ttl_s=self.session_ttl_s,
            lora_load_s=self.lora_load_s,
        )


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class RouterServer:
    def __init__(
        self,
        config: RouterConfig,
        *,
        picker: Picker | None = None,
        kube_client: httpx.AsyncClient | None = None,
        tracer: PickTracer | None = None,
    ) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        if tracer is None and config.otlp_endpoint:
            from .tracing import PickTracer  # OpenTelemetry only when tracing is on

            try:
                tracer = PickTracer(endpoint=config.otlp_endpoint)
            except ImportError as exc:  # traces are never worth failing the routing for
                log.error("--otlp-endpoint: no tracing (%s): install cachefleet[tracing]", exc)
        self.tracer = tracer
        self.pool = EndpointPool(self.metrics, require_metrics=config.scrape_interval_s > 0)
        self.tenants = TenantClasses(config.objectives)
        # precise routing: the servers' KV events and tokens (None when off)
        self.kv_index: KvIndex | None = None
        if config.kv_events != "off" or config.kv_events_listen:
            self.kv_index = KvIndex()
        self.kv_events: KvEventSubscriber | None = None
        self.tokenization: Tokenization | None = None
        if config.profile == "default":  # the only profile whose scorers read token ids
            self.tokenization = make_tokenization(config.tokenizer)
        if picker is None:
            picker = build_profile(config.profile, config.scoring(), precise=self.kv_index)
        self.service = EndpointPickerService(
            picker,
            self.pool.ready,
            tenant_header=config.tenant_header,
            class_of=self.tenants.class_of,
            objective_class=self.tenants.objective_class,
            fail_open=config.fail_open,
            metrics=self.metrics,
            max_body_bytes=config.max_body_bytes,
            max_body_memory=config.max_body_memory,
            max_streams=config.max_streams,
            conformance=config.conformance,
            tokenizer=self.tokenization,
            tracer=tracer,
        )
        self.service.session_header = config.session_header  # affinity (issue 35.6)
        self.health = HealthService(lambda: self.pool.synced)
        self.scraper: MetricsScraper | None = None
        self.discovery: KubeDiscovery | None = None
        self.tenant_sync: TenantSync | None = None
        self._kube_client = kube_client
        self._own_kube_client = kube_client is None
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.grpc_port = 0
        self.metrics_port = 0

    # ------------------------------------------------------------------ HTTP

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, _: web.Request) -> web.Response:
        ready = len(self.pool.ready())
        known = len(self.pool.endpoints())
        if not self.pool.synced:
            return web.Response(status=503, text="endpoints not known yet\n")
        return web.Response(text=f"ok: {ready} of {known} endpoints ready\n")

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        cfg = self.config
        if cfg.endpoints:
            self.pool.set_members({address: address for address in cfg.endpoints})
        else:
            client = self._kube_client or make_client(cfg.kubeconfig)
            self._kube_client = client
            self.discovery = KubeDiscovery(
                client,
                self.pool,
                cfg.namespace,
                pool_name=cfg.pool_name,
                selector=None if cfg.pool_name else cfg.selector,
                target_ports=cfg.target_ports,
            )
            self._tasks.append(asyncio.ensure_future(self.discovery.run()))
        if cfg.scrape_interval_s > 0:
            self.scraper = MetricsScraper(
                self.pool,
                cfg.scrape_interval_s,
                timeout_s=cfg.scrape_timeout_s,
                max_bytes=cfg.max_metrics_bytes,
            )
            self._tasks.append(asyncio.ensure_future(self.scraper.run()))
        if self.kv_index is not None:  # precise routing: the servers' KV events
            self.kv_events = KvEventSubscriber(
                self.kv_index,
                self.pool.endpoints,
                discover=cfg.kv_events != "off",
                listen=cfg.kv_events_listen,
            )
            self.kv_events.bind()
            self._tasks.append(asyncio.ensure_future(self.kv_events.run()))
        if cfg.redis_url and cfg.cache:
            self.tenant_sync = TenantSync(
                cfg.redis_url, cfg.cache, self.tenants, poll_s=cfg.tenant_poll_s
            )
            self._tasks.append(asyncio.ensure_future(self.tenant_sync.run()))

        # a buffered body comes in one message: room for the largest read, and its headers
        largest = max(MAX_MESSAGE_BYTES, cfg.max_body_bytes + 1024 * 1024)
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", largest)])
        pb_grpc.add_ExternalProcessorServicer_to_server(self.service, server)
        server.add_generic_rpc_handlers((self.health.handler(),))
        host, port = cfg.grpc_listen
        try:
            self.grpc_port = server.add_insecure_port(f"{_host(host)}:{port}")
        except RuntimeError as exc:  # grpc's way of saying the address is taken
            raise OSError(f"--grpc-listen {host}:{port}: cannot listen there ({exc})") from exc
        self._grpc = server
        await server.start()

        if cfg.metrics_listen is not None:
            app = web.Application()
            app.router.add_get("/metrics", self._metrics)
            app.router.add_get("/healthz", self._healthz)
            app.router.add_get("/readyz", self._readyz)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            mhost, mport = cfg.metrics_listen
            self._http = runner
            try:
                await web.TCPSite(runner, mhost, mport).start()
            except OSError as exc:
                raise OSError(f"--metrics-listen {mhost}:{mport}: {exc.strerror or exc}") from exc
            self.metrics_port = runner.addresses[0][1]
        log.info(
            "router: ext_proc + health on %s:%d, metrics on %s, %s",
            host,
            self.grpc_port,
            f"{cfg.metrics_listen[0]}:{self.metrics_port}" if cfg.metrics_listen else "off",
            f"{len(cfg.endpoints)} static endpoints"
            if cfg.endpoints
            else f"pool {cfg.pool_name}"
            if cfg.pool_name
            else f"pods {cfg.selector}",
        )

    async def stop(self, grace_s: float | None = None) -> None:
        self.health.shutting_down()
        if self._grpc is not None:
            await self._grpc.stop(self.config.grace_s if grace_s is None else grace_s)
            self._grpc = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._http is not None:
            await self._http.cleanup()
            self._http = None
        if self.scraper is not None:
            await self.scraper.aclose()
        if self.kv_events is not None:
            await self.kv_events.aclose()
        if self.tokenization is not None:
            await self.tokenization.aclose()
        if self._kube_client is not None and self._own_kube_client:
            await self._kube_client.aclose()
        self._kube_client = None
        tracer, self.tracer = self.tracer, None
        if tracer is not None:  # the last spans go out (bounded), off the loop
            await asyncio.to_thread(tracer.shutdown)


async def serve(config: RouterConfig, stop: asyncio.Event, *, picker: Picker | None = None) -> None:
    """Run until ``stop`` is set, then shut down cleanly."""
    server = RouterServer(config, picker=picker)
    try:
        await server.start()
        await stop.wait()
    finally:
        await server.stop()
