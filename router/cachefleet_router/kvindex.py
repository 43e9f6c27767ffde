"""Which prompt prefixes each endpoint holds, from its own KV-cache events (pure: no I/O).

:class:`KvIndex` keeps, per endpoint, the blocks its model server says are in
its prefix cache (:mod:`cachefleet_router.kvevents`): ``BlockStored`` adds,
``BlockRemoved`` evicts, ``AllBlocksCleared`` empties. A block is keyed by the
chain of token ids up to it: ``key(b) = xxh3_64(token ids of b, seed=key(parent))``,
the first block seeded by :data:`ROOT`. The events carry each stored block's
token ids and its parent's hash, so the router computes the same keys from a
request's token ids (:func:`chain`) without vLLM's hash function (sha256 of
pickled tuples, salted per process unless ``PYTHONHASHSEED`` is fixed). Only
blocks in GPU memory (``medium`` GPU or unsaid) of KV-cache group 0 count;
LoRA and multimodal extra keys are not part of the key (a LoRA request may
match its base model's blocks).

**When an endpoint's state is known.** Sequence numbers rise by one per
message. The state is *known* from the first message heard (sequence 0: the
publisher just started, its cache was empty; a later sequence: the router
started after the server, and what was stored before counts as not held, a
subset of the truth, as after a resync), and after an ``AllBlocksCleared``.
A jump in the sequence (messages lost: the publisher's high-water mark), or
:meth:`KvIndex.lost` (the subscriber reconnected) and a first message after
it with a later sequence, makes it *unknown*: what the endpoint holds is dropped, and it
is learned again from new events. It is known again after an
``AllBlocksCleared`` or once ``resync_blocks`` blocks have been stored since
(the picture is then a subset of the truth: the blocks that were held before
the gap and never stored again stay unknown until evicted). Until then
:meth:`KvIndex.matched` answers None and the scorer uses the approximate
index (:mod:`cachefleet_router.prefix`). A sequence that starts again at 0
is a restarted server: its cache is empty, the state known. A repeated or
older sequence (a replay) is ignored.

**Bounded memory.** At most ``max_blocks`` blocks per endpoint (the
endpoint's ``num_gpu_blocks`` and 10 % when :meth:`KvIndex.set_capacity` is
told it, else :data:`DEFAULT_MAX_BLOCKS`), checked once per message: past
that the oldest stored block is dropped (a server never holds more than its
capacity, so overflowing means removals were lost; the oldest stored is not
the least recently used, which the events do not say, hence the slack).
Per block: one entry of an ordered map (vLLM hash -> key) and one of a
counted set of keys; ``tests/unit/test_kvindex.py`` measures the bytes.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from .kvevents import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

#: the seed of a chain's first block
ROOT = 0x9E3779B97F4A7C15
#: blocks kept per endpoint when its capacity is not known (262,144 blocks of 16 tokens:
#: 4 M tokens, more than one GPU's KV cache holds)
DEFAULT_MAX_BLOCKS = 262_144
#: the bound of an endpoint whose capacity is known: its capacity and this share more
CAPACITY_SLACK = 0.1
#: stored blocks after a gap that make the endpoint's state known again
DEFAULT_RESYNC_BLOCKS = 1024
#: endpoints tracked at most (a publisher naming endpoints by topic must not grow it forever)
DEFAULT_MAX_ENDPOINTS = 4096

_MASK = 0xFFFFFFFFFFFFFFFF


def _block_key(parent: int, tokens: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(array("q", tokens).tobytes(), seed=parent)


def chain(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """The keys of the whole blocks of ``token_ids`` (at most ``limit``), first to last."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    whole = len(token_ids) // block_size
    if limit is not None:
        whole = min(whole, limit)
    if whole <= 0:
        return []
    data = memoryview(array("q", token_ids[: whole * block_size]).tobytes())
    step = 8 * block_size
    keys: list[int] = []
    prev = ROOT
    for i in range(whole):
        prev = xxhash.xxh3_64_intdigest(data[i * step : (i + 1) * step], seed=prev)
        keys.append(prev)
    return keys


@dataclass(slots=True)
class _Endpoint:
    max_blocks: int
    #: vLLM's block hash (64-bit) -> our chain key, oldest stored first
    blocks: OrderedDict[int, int] = field(default_factory=OrderedDict)
    #: chain key -> how many of the endpoint's blocks have it
    keys: dict[int, int] = field(default_factory=dict)
    block_size: int = 0
    known: bool = False
    last_seq: int | None = None
    #: blocks stored since the state became unknown
    relearned: int = 0
    gaps: int = 0


class KvIndex:
    """Per endpoint, the prefix-cache blocks its KV events say it holds."""

    def __init__(
        self,
        *,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        resync_blocks: int = DEFAULT_RESYNC_BLOCKS,
        max_endpoints: int = DEFAULT_MAX_ENDPOINTS,
    ) -> None:
        if max_blocks <= 0 or resync_blocks <= 0 or max_endpoints <= 0:
            raise ValueError("max_blocks, resync_blocks and max_endpoints must be positive")
        self.max_blocks = max_blocks
        self.resync_blocks = resync_blocks
        self.max_endpoints = max_endpoints
        self._endpoints: OrderedDict[str, _Endpoint] = OrderedDict()
        self._memo: tuple[Sequence[int], int, list[int]] | None = None

    # -- what the events say ---------------------------------------------------------------

    def apply(self, endpoint: str, seq: int, batch: EventBatch) -> None:
        """One message of ``endpoint``'s publisher, in arrival order."""
        state = self._of(endpoint)
        last = state.last_seq
        if last is None:
            if seq != 0 and state.gaps:
                self._unknown(state)  # a reconnect: what happened meanwhile is lost
            else:
                # sequence 0: a fresh server, an empty cache. A later one, the first this
                # index hears: the router joined after the server started. Either way every
                # block stored from now on is seen: known, a subset of the truth (what was
                # stored before counts as not held, as after a resync)
                state.known = True
        elif seq == 0 and last > 0:
            self._clear(state)  # the server restarted: an empty cache
            state.known = True
        elif seq <= last:
            return  # a repeat (replay): already applied
        elif seq != last + 1:
            self._unknown(state)
        state.last_seq = seq
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(state, event)
            elif isinstance(event, BlockRemoved):
                self._remove(state, event)
            elif isinstance(event, AllBlocksCleared):
                self._clear(state)
                state.known = True
        # bounded once the whole message is applied: a step that stores new blocks and
        # evicts old ones may say so in either order
        self._bound(state)

    def lost(self, endpoint: str) -> None:
        """The subscription to ``endpoint`` broke (reconnect): its state is not known."""
        state = self._endpoints.get(endpoint)
        if state is not None:
            self._unknown(state)
            state.last_seq = None

    def forget(self, endpoint: str) -> None:
        """``endpoint`` left the pool."""
        self._endpoints.pop(endpoint, None)

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        """The endpoint's KV capacity in blocks (``num_gpu_blocks``): the bound of its state,
        with :data:`CAPACITY_SLACK` to spare (removals may be reported a message late)."""
        if blocks <= 0:
            return
        state = self._of(endpoint)
        state.max_blocks = blocks + max(1, int(blocks * CAPACITY_SLACK))
        self._bound(state)

    # -- what the scorer asks --------------------------------------------------------------

    def known(self, endpoint: str) -> bool:
        state = self._endpoints.get(endpoint)
        return state is not None and state.known

    def matched(self, address: str, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """(leading blocks, their tokens) of ``token_ids`` that ``address`` holds; None when
        its state is not known."""
        state = self._endpoints.get(address)
        if state is None or not state.known:
            return None
        size = state.block_size
        if size <= 0 or not state.keys:
            return (0, 0)
        memo = self._memo
        if memo is not None and memo[0] is token_ids and memo[1] == size:
            keys = memo[2]
        else:
            keys = chain(token_ids, size)
            self._memo = (token_ids, size, keys)
        held = state.keys
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return (n, n * size)

    def blocks(self, endpoint: str) -> int:
        """Blocks ``endpoint`` is known to hold."""
        state = self._endpoints.get(endpoint)
        return len(state.blocks) if state is not None else 0

    def gaps(self, endpoint: str) -> int:
        """Times ``endpoint``'s state became unknown."""
        state = self._endpoints.get(endpoint)
        return state.gaps if state is not None else 0

    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    # -- internals -------------------------------------------------------------------------

    def _of(self, endpoint: str) -> _Endpoint:
        state = self._endpoints.get(endpoint)
        if state is None:
            state = self._endpoints[endpoint] = _Endpoint(self.max_blocks)
            while len(self._endpoints) > self.max_endpoints:
                self._endpoints.popitem(last=False)
        return state

    def _unknown(self, state: _Endpoint) -> None:
        self._clear(state)
        state.known = False
        state.relearned = 0
        state.gaps += 1

    def _clear(self, state: _Endpoint) -> None:
        state.blocks.clear()
        state.keys.clear()

    def _store(self, state: _Endpoint, event: BlockStored) -> None:
        if event.medium not in (None, MEDIUM_GPU) or event.group_idx not in (None, 0):
            return
        size = event.block_size
        if event.parent_block_hash is None:
            prev = ROOT
        else:
            parent = state.blocks.get(event.parent_block_hash)
            if parent is None:
                return  # its parent is not known here: no chain from the root reaches it
            prev = parent
        state.block_size = size
        tokens = event.token_ids
        stored = 0
        for i, vllm_hash in enumerate(event.block_hashes):
            block = tokens[i * size : (i + 1) * size]
            if len(block) < size:
                break
            key = _block_key(prev, block)
            old = state.blocks.pop(vllm_hash, None)
            if old is not None:
                self._unkey(state, old)
            state.blocks[vllm_hash] = key
            state.keys[key] = state.keys.get(key, 0) + 1
            prev = key
            stored += 1
        if not state.known:
            state.relearned += stored
            if state.relearned >= self.resync_blocks:
                state.known = True

    def _remove(self, state: _Endpoint, event: BlockRemoved) -> None:
        if event.medium not in (None, MEDIUM_GPU) or event.group_idx not in (None, 0):
            return
        for vllm_hash in event.block_hashes:
            key = state.blocks.pop(vllm_hash, None)
            if key is not None:
                self._unkey(state, key)

    def _unkey(self, state: _Endpoint, key: int) -> None:
        count = state.keys.get(key, 0) - 1
        if count > 0:
            state.keys[key] = count
        else:
            state.keys.pop(key, None)

    def _bound(self, state: _Endpoint) -> None:
        while len(state.blocks) > state.max_blocks:
            _hash, key = state.blocks.popitem(last=False)
            self._unkey(state, key)
