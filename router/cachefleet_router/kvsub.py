"""Subscribing to the model servers' KV-cache events (ZMQ + msgpack, on the event loop).

``--kv-events auto`` (default): for each member endpoint,
:class:`KvEventSubscriber` asks ``GET /kv_event_sources`` on the endpoint's
own address; a vLLM server whose events endpoint has a wildcard host
(``tcp://*:5557``) binds there, and the router connects a ZMQ SUB socket to
the endpoint's host at that port (one naming a host is connected to as
given), subscribed to the source's topic. It also reads
``vllm:cache_config_info`` from the endpoint's ``/metrics`` once, to bound the
endpoint's state by its ``num_gpu_blocks``. An endpoint without sources (an
older vLLM, SGLang, a plain OpenAI server; a 404) is asked again after
:data:`NO_SOURCE_RETRY_S`; it is routed on the approximate index meanwhile.
An endpoint that leaves the pool is unsubscribed and forgotten.

``--kv-events-listen tcp://HOST:PORT``: servers that publish to one central
address (vLLM connects when its endpoint names a host, as llm-d deploys it)
reach a SUB socket the router binds there; the pods are told apart by topic,
llm-d's ``kv@<pod address>@<model>``: a topic whose address is a member's
``host:port`` (or a member's host) is that member's; any other names its own
entry (bounded by the index).

Every message goes to :meth:`cachefleet_router.kvindex.KvIndex.apply` with its
sequence number: lost messages (the publisher's high-water mark, a reconnect
that ZMQ made silently) show as a gap there, and a restarted server as a
sequence starting again at 0. A frame that does not decode makes the
endpoint's state unknown (:meth:`~cachefleet_router.kvindex.KvIndex.lost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import zmq
import zmq.asyncio

from cachefleet_common.modelserver import vllm_cache_config

from .endpoints import Endpoint
from .kvevents import KvEventError, Source, decode_frame, event_sources
from .kvindex import KvIndex

log = logging.getLogger(__name__)

#: seconds between looks at the pool's members
DEFAULT_REFRESH_S = 2.0
#: an endpoint that names no event source is asked again after this, seconds
NO_SOURCE_RETRY_S = 60.0
#: longest wait for /kv_event_sources or /metrics, seconds
HTTP_TIMEOUT_S = 2.0
#: ZMQ's receive high-water mark per socket (messages queued before ZMQ drops: a gap)
RCV_HWM = 100_000

KV_EVENTS_MODES = ("off", "auto")


@dataclass(slots=True)
class _Subscription:
    source: Source
    socket: zmq.asyncio.Socket
    task: asyncio.Task[None]


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def topic_address(topic: str) -> str | None:
    """The pod address of an llm-d topic ``kv@<pod address>@<model>``; None otherwise."""
    parts = topic.split("@")
    if len(parts) >= 3 and parts[0] == "kv" and parts[1]:
        return parts[1]
    return None


class KvEventSubscriber:
    """Feeds a :class:`~cachefleet_router.kvindex.KvIndex` from the servers' ZMQ publishers."""

    def __init__(
        self,
        index: KvIndex,
        members: Callable[[], Sequence[Endpoint]],
        *,
        discover: bool = True,
        listen: str | None = None,
        client: httpx.AsyncClient | None = None,
        context: zmq.asyncio.Context | None = None,
        refresh_s: float = DEFAULT_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.members = members
        self.discover = discover
        self.listen = listen
        self.client = client or httpx.AsyncClient(timeout=HTTP_TIMEOUT_S)
        self._own_client = client is None
        self.context = context or zmq.asyncio.Context()
        self._own_context = context is None
        self.refresh_s = refresh_s
        self._clock = clock
        self._subs: dict[str, _Subscription] = {}
        self._retry_at: dict[str, float] = {}
        self._central: zmq.asyncio.Socket | None = None
        self._central_task: asyncio.Task[None] | None = None
        #: messages applied, and ones that did not decode
        self.frames = 0
        self.bad_frames = 0

    @property
    def bound(self) -> str | None:
        """The address the central socket is bound to (``tcp://host:*`` picks a port)."""
        if self._central is None:
            return None
        value = self._central.getsockopt(zmq.LAST_ENDPOINT)
        return value.decode() if isinstance(value, bytes) else str(value)

    def subscribed(self) -> dict[str, str]:
        """Endpoint -> the publisher address its subscription connects to."""
        return {address: sub.source.address for address, sub in self._subs.items()}

    # -- life ------------------------------------------------------------------------------

    def bind(self) -> None:
        """Bind the central SUB socket (``--kv-events-listen``); OSError when it cannot."""
        if self.listen is None or self._central is not None:
            return
        sock = self.context.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.bind(self.listen)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"--kv-events-listen {self.listen}: {exc}") from exc
        self._central = sock
        self._central_task = asyncio.ensure_future(self._read(sock, None))

    async def run(self) -> None:
        """Bind (central mode) and follow the members until cancelled."""
        self.bind()
        while True:
            if self.discover:
                await self.refresh()
            await asyncio.sleep(self.refresh_s)

    async def refresh(self) -> None:
        """Subscribe to new members' publishers; drop those that left."""
        members = {e.address: e for e in self.members()}
        for address in list(self._subs):
            if address not in members:
                await self._drop(address)
                self.index.forget(address)
        for address in [a for a in self._retry_at if a not in members]:
            del self._retry_at[address]  # bounded by the members
        now = self._clock()
        todo = [a for a in members if a not in self._subs and self._retry_at.get(a, 0.0) <= now]
        if todo:
            await asyncio.gather(*(self._subscribe(a) for a in todo))

    async def aclose(self) -> None:
        for address in list(self._subs):
            await self._drop(address)
        if self._central_task is not None:
            self._central_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._central_task
            self._central_task = None
        if self._central is not None:
            self._central.close(linger=0)
            self._central = None
        if self._own_client:
            await self.client.aclose()
        if self._own_context:
            self.context.term()

    # -- internals -------------------------------------------------------------------------

    async def _subscribe(self, address: str) -> None:
        host = _host(address)
        try:
            answer = await self.client.get(f"http://{address}/kv_event_sources")
            sources = event_sources(answer.json(), host) if answer.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            sources = []
        if self.listen is not None:  # the servers that connect to us need no subscription
            sources = [s for s in sources if s.address != self.listen]
        if not sources:
            self._retry_at[address] = self._clock() + NO_SOURCE_RETRY_S
            log.debug("%s names no KV event source; routing it on the approximate index", address)
            return
        self.index.lost(address)  # whatever came before this subscription is not known
        await self._capacity(address)
        source = sources[0]
        sock = self.context.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        try:
            sock.connect(source.address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._retry_at[address] = self._clock() + NO_SOURCE_RETRY_S
            log.info("%s: cannot connect to its KV events at %s: %s", address, source.address, exc)
            return
        task = asyncio.ensure_future(self._read(sock, address))
        self._subs[address] = _Subscription(source, sock, task)
        log.info("%s: subscribed to its KV events at %s", address, source.address)

    async def _capacity(self, address: str) -> None:
        try:
            answer = await self.client.get(f"http://{address}/metrics")
        except httpx.HTTPError:
            return
        config = vllm_cache_config(answer.text) if answer.status_code == 200 else None
        if config is not None and config[1]:
            self.index.set_capacity(address, config[1])

    async def _drop(self, address: str) -> None:
        sub = self._subs.pop(address, None)
        if sub is None:
            return
        sub.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sub.task
        sub.socket.close(linger=0)

    def _resolve(self, topic: str) -> str | None:
        named = topic_address(topic)
        if named is None:
            return None
        members = [e.address for e in self.members()]
        if named in members:
            return named
        for address in members:
            if _host(address) == named.strip("[]"):
                return address
        return named

    async def _read(self, sock: zmq.asyncio.Socket, address: str | None) -> None:
        while True:
            parts = await sock.recv_multipart()
            try:
                frame = decode_frame(parts)
            except KvEventError as exc:
                self.bad_frames += 1
                target = address
                if target is None and parts:
                    target = self._resolve(bytes(parts[0]).decode("utf-8", "replace"))
                if target is not None:
                    self.index.lost(target)
                log.warning("KV event frame from %s not understood: %s", target or "?", exc)
                continue
            target = address if address is not None else self._resolve(frame.topic)
            if target is None:
                continue
            self.frames += 1
            gaps = self.index.gaps(target)
            self.index.apply(target, frame.seq, frame.batch)
            if self.index.gaps(target) > gaps:
                log.info(
                    "%s: KV events lost (sequence %d); its state is not known: routed on the "
                    "approximate index until a clear or enough new blocks",
                    target,
                    frame.seq,
                )
