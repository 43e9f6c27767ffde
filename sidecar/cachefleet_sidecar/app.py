"""The sidecar process: its listening sockets, the Redis tier, the control sync, the CLI.

:class:`SidecarServer` starts and stops what :func:`compose.build` made; the
request path itself is :class:`handler.Handler` (read :mod:`compose` for the
map of the parts).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from cachefleet_common.contract.urls import redact_url
from cachefleet_sidecar.admin import L2_USAGE_REFRESH_S, AdminHandler
from cachefleet_sidecar.compose import Sidecar, build
from cachefleet_sidecar.config import SidecarConfig, parse_args
from cachefleet_sidecar.http.server import Connection
from cachefleet_sidecar.tenancy.identity import API_KEYS_POLL_S
from cachefleet_sidecar.tenancy.tenants import IDLE_TICK_S

if TYPE_CHECKING:
    from cachefleet_sidecar.control.control import ControlSync

log = logging.getLogger("cachefleet.sidecar")


class SidecarServer:
    """Owns the listening sockets, the background loops and the control sync."""

    def __init__(self, config: SidecarConfig, sidecar: Sidecar | None = None) -> None:
        self.config = config
        self.sidecar = sidecar or build(config)
        self.limiter = self.sidecar.limiter
        self.connections = self.limiter.connections
        self.servers: list[asyncio.Server] = []
        self.control: ControlSync | None = None
        self._usage_task: asyncio.Task[None] | None = None
        self._keys_task: asyncio.Task[None] | None = None
        self._idle_task: asyncio.Task[None] | None = None
        self._l3_task: asyncio.Task[None] | None = None
        self._warm_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        cfg, sc = self.config, self.sidecar
        # The local model loads in the background (seconds): requests are served meanwhile.
        self._l3_task = loop.create_task(sc.l3.start())
        if sc.gate is not None:
            sc.gate.start()
        l2 = sc.l2
        if cfg.redis_url:
            from cachefleet_sidecar.control.control import (
                ControlSync,  # redis-py only for sidecars that use Redis
            )

            if l2 is not None:
                await l2.connect()
            sc.keying.enable_epochs()
            self.control = ControlSync(
                cfg.redis_url,
                cfg.cache,
                cfg.pod,
                sc.quotas.apply,
                heartbeat=sc.admin.heartbeat,
                tracker=sc.tracker,
                on_epochs=sc.keying.on_epochs,
                on_redis_reset=None if l2 is None else l2.forget_registrations,
                on_purge=sc.upkeep.on_purge,
                # The poll keeps the strict cadence even when serve-stale lengthens the bound.
                epoch_poll_s=cfg.control.staleness_bound_s / 4,
            )
            if l2 is not None:
                l2.on_behind = self.control.poke
            await self.control.start()
            if sc.fleet is not None:
                sc.fleet.start()
            self._usage_task = loop.create_task(self._refresh_usage())
            if cfg.control.warm_bytes > 0 and l2 is not None:
                control, tracker = self.control, sc.tracker
                sc.upkeep.warm.state = "running"  # not ready until it ends
                self._warm_task = loop.create_task(
                    sc.upkeep.warm_up(lambda: tracker.fresh() and control.last_sync_at is not None)
                )
        api_keys = sc.tenants.api_keys
        if api_keys is not None and api_keys.path is not None:
            self._keys_task = loop.create_task(self._poll_api_keys())
        if cfg.tenancy.tenant_idle_expiry_s > 0:
            self._idle_task = loop.create_task(self._expire_idle())
        handler = sc.front
        main = await loop.create_server(
            lambda: Connection(handler, self.limiter), *cfg.listen, reuse_address=True
        )
        self.servers.append(main)
        self.limiter.start()
        if cfg.admin_listen is not None:
            admin = AdminHandler(sc.admin)
            self.servers.append(
                await loop.create_server(
                    lambda: Connection(admin, self.limiter),
                    *cfg.admin_listen,
                    reuse_address=True,
                )
            )
        log.info(
            "cachefleet sidecar on %s:%d -> %s (L1 %d bytes, policy %s, redis %s)",
            *cfg.listen,
            redact_url(cfg.http.upstream),
            cfg.caching.l1_bytes,
            cfg.caching.policy.value,
            "on" if cfg.redis_url else "off",
        )

    async def _refresh_usage(self) -> None:
        while True:
            await asyncio.sleep(L2_USAGE_REFRESH_S)
            try:
                await self.sidecar.admin.refresh_l2_usage()
            except Exception as exc:  # never fatal: the gauges just stay older
                log.debug("L2 usage refresh failed: %s", exc)

    async def _expire_idle(self) -> None:
        ticks = max(1, math.ceil(self.config.tenancy.tenant_idle_expiry_s / IDLE_TICK_S))
        while True:
            await asyncio.sleep(IDLE_TICK_S)
            self.sidecar.tenants.expire_idle(ticks)

    async def _poll_api_keys(self) -> None:
        while True:
            await asyncio.sleep(API_KEYS_POLL_S)
            try:
                self.sidecar.tenants.poll_api_keys()
            except Exception as exc:  # never fatal: the old keys stay in force
                log.warning("API-keys reload failed: %s", type(exc).__name__)

    @property
    def ports(self) -> list[int]:
        return [int(s.sockets[0].getsockname()[1]) for s in self.servers]

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then close."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        for server in self.servers:
            server.close()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for conn in list(self.connections):
                if not conn.busy and not conn.pending:
                    conn.close()
            if not self.connections:
                break
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.close()
        self.limiter.stop()
        if self._warm_task is not None:
            self._warm_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warm_task
        for task in (self._usage_task, self._keys_task, self._idle_task, self._l3_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.sidecar.fleet is not None:
            await self.sidecar.fleet.stop()
        if self.control is not None:
            await self.control.stop()
        await self.sidecar.aclose()


async def serve(config: SidecarConfig) -> None:
    server = SidecarServer(config)
    await server.start()
    # Everything allocated so far lives as long as the process: keep it out of
    # the cyclic GC's full collections, whose pauses would land on requests.
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: finishing in-flight requests (up to %gs)", config.shutdown_grace_s)
    await server.stop()


def main(argv: list[str]) -> int:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    try:
        runner(serve(config))
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
