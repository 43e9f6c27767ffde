"""Background tasks nobody awaits (L2 writes, L3 comparisons, quota writes, migrations)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


class Background:
    """Keeps a reference to each task until it ends; waits for them, bounded, on close."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def aclose(self, timeout_s: float = 1.0) -> None:
        """Let each task finish, each within ``timeout_s`` (then it is cancelled)."""
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout_s)
