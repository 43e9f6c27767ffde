"""An approximate per-endpoint index of the prompt prefixes a model server holds.

Pure: no I/O. The picker keeps one :class:`PrefixIndex` per endpoint and
records in it the chained block hashes of every prompt it sends there (see
:attr:`cachefleet_router.endpoints.RouteRequest.blocks`). It never sees the
model server's real KV cache, so the index is a guess: it forgets what the
server evicted only when its own LRU evicts it too, and it knows nothing of
what other router replicas sent. The scoring corrects it with the server's
measured prefix hit ratio (:mod:`cachefleet_router.scoring`).

Memory is bounded: at most ``capacity`` blocks, least recently used first
out. A prompt's blocks are touched last-to-first, so its first block is the
most recent and eviction eats a prefix from its tail, as a server's prefix
cache does (vLLM frees a request's blocks tail first). With chained hashes a
block can only be matched after all blocks before it, so the tail is also
the part that matters least.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from cachefleet_common.modelserver import ModelServerMetrics

#: Index capacity, in blocks, when the model server does not say its KV capacity
#: (16,384 blocks of 512 tokens: 8 M tokens, more than any single GPU holds).
DEFAULT_INDEX_BLOCKS = 16_384


def capacity_blocks(
    metrics: ModelServerMetrics | None, block_tokens: int, default: int = DEFAULT_INDEX_BLOCKS
) -> int:
    """Blocks the index of one endpoint may hold: its KV capacity when its metrics say it."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, not {block_tokens}")
    if default <= 0:
        raise ValueError(f"default index capacity must be positive, not {default}")
    if metrics is not None and metrics.kv_capacity_tokens and metrics.kv_capacity_tokens > 0:
        return max(1, metrics.kv_capacity_tokens // block_tokens)
    return default


class PrefixIndex:
    """The chained block hashes one endpoint is believed to hold; LRU, bounded."""

    __slots__ = ("_blocks", "_capacity")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"prefix index capacity must be positive, not {capacity}")
        self._capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    @property
    def capacity(self) -> int:
        """The most blocks held."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def resize(self, capacity: int) -> None:
        """A new bound (the server's KV capacity became known); shrinking evicts LRU blocks."""
        if capacity <= 0:
            raise ValueError(f"prefix index capacity must be positive, not {capacity}")
        self._capacity = capacity
        self._evict()

    def matched(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` are held (0 when the first is not).

        A lookup does not refresh recency: only a request routed here does (:meth:`insert`).
        """
        held = self._blocks
        count = 0
        for block in blocks:
            if block not in held:
                break
            count += 1
        return count

    def insert(self, blocks: Sequence[int]) -> None:
        """The endpoint now holds ``blocks``: add or refresh them, first block most recent."""
        held = self._blocks
        for block in reversed(blocks):
            if block in held:
                held.move_to_end(block)
            else:
                held[block] = None
        self._evict()

    def discard(self, blocks: Sequence[int]) -> None:
        """Forget ``blocks`` (the endpoint lost them: a restart, a failed request)."""
        for block in blocks:
            self._blocks.pop(block, None)

    def clear(self) -> None:
        self._blocks.clear()

    def _evict(self) -> None:
        held = self._blocks
        while len(held) > self._capacity:
            held.popitem(last=False)
