"""Which endpoints exist and which may take a request: members, metrics, readiness.

* :class:`EndpointPool` holds the endpoints. Membership comes from a source
  (:meth:`EndpointPool.set_members`); readiness from the scraper. An endpoint
  is ready once a reading of its ``/metrics`` succeeded, and out after
  :data:`FAILURES_OUT` failed readings in a row, back at the next good one.
  A good reading is an answer with a known model server's series (vLLM,
  SGLang, TensorRT-LLM: parsed by
  :func:`cachefleet_common.modelserver.parse_metrics`), or a clean
  answer without any (another server: TGI, llama.cpp...), or a 404 (no
  ``/metrics`` at all): those last two are ready and routed by load alone,
  the requests this router has in flight there. A failed reading is an error
  status other than 404, a connection fault, an answer not complete within
  :data:`SCRAPE_TIMEOUT_S` (however slowly its bytes trickle) or longer than
  :data:`MAX_METRICS_BYTES`. Why an endpoint is not ready is logged once (at
  info), not every period. With scraping off, members are ready as they arrive.
* :class:`MetricsScraper` reads every member's ``/metrics`` on its own
  address, each member on its own schedule (a stalled endpoint delays no other
  endpoint's readings), with httpx, streaming the answer up to the cap.
* :class:`KubeDiscovery` lists and watches, on the event loop, the pods of a
  label selector — given directly, or an ``InferencePool``'s
  (``inference.networking.k8s.io/v1``: ``spec.selector.matchLabels`` and
  ``spec.targetPorts[].number``, each port its own endpoint ``podIP:port``),
  whose changes it follows too. A pod is a member while it is Running, Ready,
  has an IP and is not being deleted; one watch event that says otherwise
  (or its deletion) takes it out. The watch resumes from the last
  ``resourceVersion`` and lists again when the server says it is too old
  (410) or the connection fails (bounded backoff).

The pure parts (:func:`pod_members`, :func:`pool_target`, :func:`matches`) take
API objects as plain dicts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from cachefleet_common.modelserver import (
    MetricsParseError,
    ModelServerMetrics,
    parse_metrics,
)

from .endpoints import Endpoint
from .metrics import RouterMetrics

log = logging.getLogger(__name__)

#: failed ``/metrics`` reads in a row after which an endpoint is out
FAILURES_OUT = 2
#: the longest one ``/metrics`` reading may take, all of it (connect to last byte), seconds
SCRAPE_TIMEOUT_S = 1.0
#: the largest ``/metrics`` answer read; a longer one is a failed reading (4 MiB)
MAX_METRICS_BYTES = 4 * 1024 * 1024
#: the watch asks the API server to end the stream after this many seconds (then resumes)
WATCH_TIMEOUT_S = 300
WATCH_BACKOFF_MIN_S = 0.5
WATCH_BACKOFF_MAX_S = 30.0
#: a watch that lived this long ended normally; shorter ones are retried after a pause
WATCH_MIN_LIFE_S = 10.0

POOL_GROUP_VERSION = "inference.networking.k8s.io/v1"


@dataclass(frozen=True, slots=True)
class Reading:
    """What one read of an endpoint's ``/metrics`` gave."""

    #: the answer's text (HTTP 200)
    text: str | None = None
    #: the server has no ``/metrics`` (HTTP 404): ready, routed by load alone
    missing: bool = False
    #: why the reading failed (empty: it did not)
    error: str = ""


class EndpointPool:
    """The endpoints a request may go to; one instance per router, shared by its rooms."""

    def __init__(self, metrics: RouterMetrics | None = None, *, require_metrics: bool = True):
        self.metrics = metrics
        #: False: members are ready on arrival (no scraper runs)
        self.require_metrics = require_metrics
        self._endpoints: dict[str, Endpoint] = {}
        self._failures: dict[str, int] = {}
        #: the last state logged per endpoint, so that each reason is logged once
        self._said: dict[str, str] = {}
        #: the source has said at least once what the members are (readiness of the router)
        self.synced = False
        self._changed: list[Callable[[], None]] = []

    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def ready(self) -> list[Endpoint]:
        return [e for e in self._endpoints.values() if e.ready]

    def get(self, address: str) -> Endpoint | None:
        return self._endpoints.get(address)

    def set_members(self, members: Mapping[str, str]) -> None:
        """Make ``members`` (address -> name) the whole pool: new ones join, missing ones leave."""
        for address in list(self._endpoints):
            if address not in members:
                del self._endpoints[address]
                self._failures.pop(address, None)
                self._said.pop(address, None)
                if self.metrics is not None:
                    self.metrics.forget_endpoint(address)
                log.info("endpoint %s left the pool", address)
        for address, name in members.items():
            known = self._endpoints.get(address)
            if known is None:
                self._endpoints[address] = Endpoint(
                    address=address, ready=not self.require_metrics, name=name or address
                )
                log.info("endpoint %s (%s) joined the pool", address, name or address)
            elif name:
                known.name = name
        self.synced = True
        self._update_gauges()

    def _say(self, address: str, state: str, level: int, message: str, *args: object) -> None:
        """Log ``message`` when ``address``'s state is new (each reason once, not every period)."""
        if self._said.get(address) != state:
            self._said[address] = state
            log.log(level, message, *args)

    def record_reading(self, address: str, reading: Reading) -> bool:
        """One read of ``address``'s ``/metrics``; True if it gave a model server's metrics.

        A failed reading counts towards :data:`FAILURES_OUT`. A clean answer without
        any known series, or a 404, is a good reading without metrics: the endpoint is
        ready and routed by load alone (the router's own requests in flight there).
        """
        endpoint = self._endpoints.get(address)
        if endpoint is None:  # left the pool while it was being read
            return False
        parsed: ModelServerMetrics | None = None
        by_load = ""
        if reading.missing:
            by_load = "its /metrics answers 404"
        elif reading.text is not None and not reading.error:
            try:
                parsed = parse_metrics(reading.text)
            except MetricsParseError:
                by_load = "its /metrics has no vLLM, SGLang or TensorRT-LLM series"
        if reading.error or (parsed is None and not by_load):
            failures = self._failures.get(address, 0) + 1
            self._failures[address] = failures
            if self.metrics is not None:
                self.metrics.scrape_failures.labels(address).inc()
            why = reading.error or "failed"
            if failures >= FAILURES_OUT and endpoint.ready:
                endpoint.ready = False
                self._say(
                    address,
                    f"out:{why}",
                    logging.WARNING,
                    "endpoint %s out: %d failed metrics reads (last: %s)",
                    address,
                    failures,
                    why,
                )
            elif not endpoint.ready:
                self._say(
                    address,
                    f"unready:{why}",
                    logging.INFO,
                    "endpoint %s not ready: reading its /metrics failed: %s",
                    address,
                    why,
                )
        else:
            self._failures[address] = 0
            endpoint.metrics = parsed
            endpoint.scraped_at = time.monotonic()
            endpoint.ready = True
            if parsed is not None:
                self._say(address, "ready", logging.INFO, "endpoint %s ready", address)
            else:
                self._say(
                    address,
                    "by-load",
                    logging.INFO,
                    "endpoint %s ready, routed by load alone: %s",
                    address,
                    by_load,
                )
        self._update_gauges()
        return parsed is not None

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.endpoints.set(len(self._endpoints))
            self.metrics.endpoints_ready.set(sum(1 for e in self._endpoints.values() if e.ready))


class MetricsScraper:
    """Reads every member's ``/metrics`` (``http://<address>/metrics``), each on its own.

    :meth:`run` keeps one reading per member going at a time, a new one every
    ``interval_s`` after the last began (or as soon as it ends, when it took
    longer): a slow endpoint delays nobody else's readings. Each reading is
    bounded in total time (``timeout_s``, connection to last byte, however the
    bytes trickle) and in size (``max_bytes``, read as a stream and abandoned
    past the cap); either is a failed reading.
    """

    def __init__(
        self,
        pool: EndpointPool,
        interval_s: float,
        *,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = SCRAPE_TIMEOUT_S,
        max_bytes: int = MAX_METRICS_BYTES,
    ) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._client = client
        self._own_client = client is None
        self._reading: dict[str, asyncio.Task[None]] = {}
        self.rounds = 0
        #: answer bytes received, all readings together (for tests and logs)
        self.bytes_read = 0

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=self.timeout_s,
                trust_env=False,
                # one connection per endpoint; never wait for a slot behind a stalled one
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            )
        return self._client

    async def read(self, address: str) -> Reading:
        """One reading of ``address``'s ``/metrics``, bounded in time and size; never raises."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._read(address)
        except TimeoutError:
            return Reading(error=f"no complete answer within {self.timeout_s:g} s")
        except httpx.HTTPError as exc:
            return Reading(error=str(exc) or type(exc).__name__)
        except Exception as exc:  # whatever a hostile server provokes is a failed reading
            log.debug("metrics of %s", address, exc_info=True)
            return Reading(error=type(exc).__name__)

    async def _read(self, address: str) -> Reading:
        request = self._http().stream(
            "GET",
            f"http://{address}/metrics",
            headers={"Accept-Encoding": "identity"},
            timeout=self.timeout_s,
        )
        async with request as response:
            if response.status_code == 404:
                return Reading(missing=True)
            if response.status_code != 200:
                return Reading(error=f"HTTP {response.status_code}")
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in {"", "identity"}:
                return Reading(error=f"answer in {encoding!r}, not the identity asked for")
            if response.headers.get("content-type", "").lower().startswith("text/html"):
                return Reading(error="an HTML page, not Prometheus text")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_bytes:
                return Reading(error=f"answer over {self.max_bytes} bytes")
            body = bytearray()
            async for chunk in response.aiter_raw():
                self.bytes_read += len(chunk)
                body += chunk
                if len(body) > self.max_bytes:
                    return Reading(error=f"answer over {self.max_bytes} bytes")
        return Reading(text=body.decode("utf-8", "replace"))

    async def _scrape(self, address: str) -> None:
        reading = await self.read(address)
        if reading.error:
            log.debug("metrics of %s: %s", address, reading.error)
        self.pool.record_reading(address, reading)

    async def scrape_once(self) -> None:
        """Read every member once, concurrently; each reading is bounded by ``timeout_s``."""
        await asyncio.gather(*(self._scrape(e.address) for e in self.pool.endpoints()))
        self.rounds += 1

    def _start_readings(self) -> None:
        """A reading for every member that has none going; those of gone members are dropped."""
        members = {e.address for e in self.pool.endpoints()}
        for address, task in list(self._reading.items()):
            if task.done():
                del self._reading[address]
                if not task.cancelled() and task.exception() is not None:
                    log.error("metrics of %s", address, exc_info=task.exception())
            elif address not in members:
                task.cancel()
                del self._reading[address]
        for address in members - self._reading.keys():
            self._reading[address] = asyncio.ensure_future(self._scrape(address))

    async def run(self) -> None:
        try:
            while True:
                try:
                    self._start_readings()
                    self.rounds += 1
                except Exception:  # the loop must outlive any fault
                    log.exception("metrics scrape round failed")
                await asyncio.sleep(self.interval_s)
        finally:
            for task in self._reading.values():
                task.cancel()
            for task in self._reading.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self._reading.clear()

    async def aclose(self) -> None:
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None


# ------------------------------------------------------------------ pure Kubernetes parts


def matches(labels: Mapping[str, str] | None, selector: Mapping[str, str]) -> bool:
    """True if ``labels`` carry every ``selector`` pair (an empty selector matches nothing)."""
    if not selector:
        return False
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def pod_members(
    pods: Iterable[Mapping[str, Any]], selector: Mapping[str, str], ports: Iterable[int]
) -> dict[str, str]:
    """address -> pod name of every ready pod matching ``selector``, one address per port."""
    ports = tuple(ports)
    out: dict[str, str] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        if not matches(meta.get("labels"), selector) or not _pod_ready(pod):
            continue
        ip = str(pod["status"]["podIP"])
        for port in ports:
            out[join_host_port(ip, port)] = str(meta.get("name", ""))
    return out


def pool_target(pool: Mapping[str, Any]) -> tuple[dict[str, str], tuple[int, ...]]:
    """An InferencePool's ``(matchLabels, target port numbers)``; ValueError names the bad field."""
    spec = pool.get("spec")
    if not isinstance(spec, Mapping):
        raise ValueError("spec: missing")
    selector = (spec.get("selector") or {}).get("matchLabels")
    if not isinstance(selector, Mapping) or not selector:
        raise ValueError("spec.selector.matchLabels: missing or empty")
    raw_ports = spec.get("targetPorts")
    if not isinstance(raw_ports, list) or not raw_ports:
        raise ValueError("spec.targetPorts: missing or empty")
    ports: list[int] = []
    for i, item in enumerate(raw_ports):
        number = item.get("number") if isinstance(item, Mapping) else None
        if not isinstance(number, int) or not 1 <= number <= 65535:
            raise ValueError(f"spec.targetPorts[{i}].number: expected 1..65535, got {number!r}")
        ports.append(number)
    return {str(k): str(v) for k, v in selector.items()}, tuple(ports)


def selector_query(selector: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


# ------------------------------------------------------------------ the watch


class _Resync(Exception):
    """The watch must list again (410 Gone, or an ERROR event)."""


class KubeDiscovery:
    """Pods of a selector (or of an InferencePool) as the pool's members, kept by list + watch."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        pool: EndpointPool,
        namespace: str,
        *,
        pool_name: str | None = None,
        selector: Mapping[str, str] | None = None,
        target_ports: Iterable[int] = (),
    ) -> None:
        if (pool_name is None) == (selector is None):
            raise ValueError("give exactly one of pool_name and selector")
        self.client = client
        self.pool = pool
        self.namespace = namespace
        self.pool_name = pool_name
        self.selector = dict(selector or {})
        self.ports = tuple(target_ports)
        self._pods: dict[str, Mapping[str, Any]] = {}
        #: WATCH requests opened (pods and pools), for tests and logs
        self.watches_opened = 0
        self.lists = 0

    # -- paths

    def _pods_path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods"

    def _pools_path(self) -> str:
        return f"/apis/{POOL_GROUP_VERSION}/namespaces/{self.namespace}/inferencepools"

    # -- the pods of one selector

    def _publish(self) -> None:
        self.pool.set_members(pod_members(self._pods.values(), self.selector, self.ports))

    def _apply(self, event: Mapping[str, Any]) -> str | None:
        """One watch event applied to the pods; returns its resourceVersion."""
        kind = event.get("type")
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        if kind == "ERROR":
            raise _Resync(str(obj.get("message") or obj))
        version = meta.get("resourceVersion")
        if kind == "BOOKMARK":
            return str(version) if version else None
        name = meta.get("name")
        if not name:
            return None
        if kind == "DELETED":
            self._pods.pop(name, None)
        elif kind in {"ADDED", "MODIFIED"}:
            self._pods[name] = obj
        self._publish()
        return str(version) if version else None

    async def _list_pods(self) -> str | None:
        params = {"labelSelector": selector_query(self.selector)}
        response = await self.client.get(self._pods_path(), params=params)
        response.raise_for_status()
        body = response.json()
        self.lists += 1
        self._pods = {
            item["metadata"]["name"]: item
            for item in body.get("items") or []
            if (item.get("metadata") or {}).get("name")
        }
        self._publish()
        version = (body.get("metadata") or {}).get("resourceVersion")
        return str(version) if version else None

    async def _stream(
        self, path: str, params: dict[str, str], on_event: Callable[[Mapping[str, Any]], str | None]
    ) -> None:
        """One watch request, events handed to ``on_event`` until the server ends it."""
        query = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
            **params,
        }
        timeout = httpx.Timeout(10.0, read=WATCH_TIMEOUT_S + 30.0)
        async with self.client.stream("GET", path, params=query, timeout=timeout) as response:
            if response.status_code == 410:
                raise _Resync("resourceVersion too old")
            response.raise_for_status()
            self.watches_opened += 1
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = orjson.loads(line)
                if isinstance(event, dict):
                    version = on_event(event)
                    if version:
                        params["resourceVersion"] = version
                        query["resourceVersion"] = version

    async def watch_pods(self) -> None:
        """List + watch the pods of the current selector, forever (bounded backoff on faults)."""
        backoff = WATCH_BACKOFF_MIN_S
        loop = asyncio.get_running_loop()
        while True:
            opened = loop.time()
            try:
                version = await self._list_pods()
                params = {"labelSelector": selector_query(self.selector)}
                if version:
                    params["resourceVersion"] = version
                await self._stream(self._pods_path(), params, self._apply)
                # The server ended the watch (timeoutSeconds): list and watch again, at
                # once after a long watch, after a growing pause when they keep ending early.
                if loop.time() - opened >= WATCH_MIN_LIFE_S:
                    backoff = WATCH_BACKOFF_MIN_S
                    continue
            except _Resync as exc:
                log.info("pods watch: %s; listing again", exc)
                if loop.time() - opened >= WATCH_MIN_LIFE_S:
                    backoff = WATCH_BACKOFF_MIN_S
            except (httpx.HTTPError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
                log.warning(
                    "pods of %s in %s: %s; retrying in %.1fs",
                    selector_query(self.selector),
                    self.namespace,
                    str(exc) or type(exc).__name__,
                    backoff,
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, WATCH_BACKOFF_MAX_S)

    # -- an InferencePool

    async def _follow_pool(
        self, pool: Mapping[str, Any] | None, pods: list[asyncio.Task[None]]
    ) -> None:
        """Point the pods watch at ``pool``'s selector and ports (None: the pool is gone)."""
        target: tuple[dict[str, str], tuple[int, ...]] | None = None
        if pool is not None:
            try:
                target = pool_target(pool)
            except ValueError as exc:
                log.error("InferencePool %s/%s: %s", self.namespace, self.pool_name, exc)
        if target is not None and pods and target == (self.selector, self.ports):
            return
        for task in pods:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        pods.clear()
        if target is None:
            self._pods = {}
            self.selector, self.ports = {}, ()
            self.pool.set_members({})
            return
        self.selector, self.ports = target
        log.info(
            "InferencePool %s/%s: pods %s, ports %s",
            self.namespace,
            self.pool_name,
            selector_query(self.selector),
            ",".join(map(str, self.ports)),
        )
        pods.append(asyncio.ensure_future(self.watch_pods()))

    async def watch_pool(self) -> None:
        pods: list[asyncio.Task[None]] = []
        backoff = WATCH_BACKOFF_MIN_S
        path = f"{self._pools_path()}/{self.pool_name}"
        loop = asyncio.get_running_loop()
        try:
            while True:
                opened = loop.time()
                try:
                    response = await self.client.get(path)
                    if response.status_code == 404:
                        log.error("InferencePool %s/%s not found", self.namespace, self.pool_name)
                        await self._follow_pool(None, pods)
                        version = None
                    else:
                        response.raise_for_status()
                        body = response.json()
                        await self._follow_pool(body, pods)
                        version = (body.get("metadata") or {}).get("resourceVersion")
                    if not pods:
                        self.pool.synced = True  # known: there is nothing to route to
                    changes: asyncio.Queue[Mapping[str, Any] | None] = asyncio.Queue()

                    def on_event(
                        event: Mapping[str, Any],
                        changes: asyncio.Queue[Mapping[str, Any] | None] = changes,
                    ) -> str | None:
                        obj = event.get("object") or {}
                        meta = obj.get("metadata") or {}
                        if event.get("type") == "ERROR":
                            raise _Resync(str(obj.get("message") or obj))
                        if event.get("type") == "BOOKMARK" or meta.get("name") != self.pool_name:
                            return None
                        changes.put_nowait(None if event.get("type") == "DELETED" else obj)
                        return None

                    params = {"fieldSelector": f"metadata.name={self.pool_name}"}
                    if version:
                        params["resourceVersion"] = str(version)
                    stream = asyncio.ensure_future(
                        self._stream(self._pools_path(), params, on_event)
                    )
                    try:
                        while not stream.done():
                            getter = asyncio.ensure_future(changes.get())
                            await asyncio.wait(
                                {stream, getter}, return_when=asyncio.FIRST_COMPLETED
                            )
                            if getter.done():
                                await self._follow_pool(getter.result(), pods)
                            else:
                                getter.cancel()
                        while not changes.empty():
                            await self._follow_pool(changes.get_nowait(), pods)
                        stream.result()
                    finally:
                        stream.cancel()
                    if loop.time() - opened >= WATCH_MIN_LIFE_S:  # ended normally
                        backoff = WATCH_BACKOFF_MIN_S
                        continue
                except _Resync as exc:
                    log.info("InferencePool watch: %s; reading again", exc)
                    if loop.time() - opened >= WATCH_MIN_LIFE_S:
                        backoff = WATCH_BACKOFF_MIN_S
                except (httpx.HTTPError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
                    log.warning(
                        "InferencePool %s/%s: %s; retrying in %.1fs",
                        self.namespace,
                        self.pool_name,
                        str(exc) or type(exc).__name__,
                        backoff,
                    )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, WATCH_BACKOFF_MAX_S)
        finally:
            for task in pods:
                task.cancel()
            for task in pods:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def run(self) -> None:
        if self.pool_name is not None:
            await self.watch_pool()
        else:
            await self.watch_pods()
