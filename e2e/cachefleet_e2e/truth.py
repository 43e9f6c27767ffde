"""The stale-read checker of invalidation: an upstream that tells the truth's version.

:class:`VersionedUpstream` is a stand-in model server whose answers carry the
current *truth version*; a test or benchmark bumps it just before each
invalidation. A read that started after an invalidation was acknowledged and
still returns an older version (from any tier) is stale: :func:`stale_reads`
finds them. Used by the invalidation tests and ``cachefleet bench
invalidation``; the model of every request is :data:`MODEL`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import orjson
from aiohttp import web

from cachefleet_common.epochs import model_scope, tenant_scope

from .services import free_port

MODEL = "m1"


class VersionedUpstream:
    """An OpenAI-ish ``/v1/chat/completions`` answering with the current version."""

    def __init__(self) -> None:
        self.version = 1
        self.calls = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    def bump(self) -> int:
        """Advance the truth; returns the new version."""
        self.version += 1
        return self.version

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls += 1
        version = self.version
        content = f"{body['messages'][0]['content']}@v{version}"
        doc = {
            "id": f"r{self.calls}",
            "object": "chat.completion",
            "version": version,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
        }
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


@dataclass(frozen=True, slots=True)
class Read:
    """One client read: when it started, for whom, what version came back, from where."""

    started: float
    tenant: str
    version: int
    tier: str


#: An acknowledged invalidation: (acknowledged at, scope, truth version it guarantees).
Done = tuple[float, str, int]


def covers(scope: str, tenant: str) -> bool:
    """Does an invalidation of ``scope`` cover a read of ``tenant`` (model :data:`MODEL`)?"""
    return scope in ("cache", model_scope(MODEL), tenant_scope(tenant))


def stale_reads(reads: Iterable[Read], done: Iterable[Done]) -> list[tuple[Read, str, int]]:
    """Reads that began after an acknowledged invalidation covering them, yet are older."""
    acknowledged = list(done)
    return [
        (r, scope, v)
        for r in reads
        for at, scope, v in acknowledged
        if r.started > at and covers(scope, r.tenant) and r.version < v
    ]
