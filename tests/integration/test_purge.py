"""Key purges and namespaces, end to end: real Redis, several real sidecars.

What a user would notice:

* a Key purge (one entry, by the digest L2 names it by: the ``X-Cache-Key``
  of a hit) completes once every sidecar acknowledged it, and from then on
  no sidecar answers that request with the old answer, from L1 or L2, while
  every other entry stays cached;
* a writer that fetched its answer before the purge cannot put it back in L2;
* requests hammering a key while it is purged again and again never read an
  answer older than the last completed purge (the checker);
* a purge log that no longer holds what a sidecar missed empties its L1;
* ``X-Cache-Namespace`` partitions a tenant's entries, a Namespace
  invalidation empties only that namespace, the header's name is a flag, and
  a malformed value is refused naming the header.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator

import pytest

from cachefleet_common.contract import ops
from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.names import entry_key
from cachefleet_common.contract.ops import log_purge, purge_fence
from cachefleet_common.epochs import PURGE_SCOPE, namespace_scope
from cachefleet_e2e.truth import VersionedUpstream
from cachefleet_operator.invalidation import Invalidator
from cachefleet_sidecar.cache.l2 import RedisL2
from tests.integration.conftest import RunningSidecar, SidecarFactory

pytestmark = [pytest.mark.redis]

CACHE = "test/cache"
ACK_TIMEOUT_S = 20.0  # generous: a loaded machine only waits longer
POLL_S = 0.05
#: Bound on waiting for background L2 writes, seconds.
SETTLE_S = 5.0


async def ask(
    sc: RunningSidecar, prompt: str, tenant: str = "acme", namespace: str | None = None
) -> tuple[int, str]:
    headers = {} if namespace is None else {"X-Cache-Namespace": namespace}
    resp = await sc.chat(prompt, tenant=tenant, headers=headers)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["version"]), resp.headers["x-cache"]


async def until_acked(sc: RunningSidecar) -> None:
    deadline = time.monotonic() + ACK_TIMEOUT_S
    while time.monotonic() < deadline:
        if sc.server.control.acks_written > 0 and sc.sidecar.tracker.fresh():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the sidecar never acknowledged its epochs")


async def fleet(factory: SidecarFactory, url: str, upstream: str, n: int) -> list[RunningSidecar]:
    # patient: a loaded machine must not turn an L2 hit the test expects into a miss
    pods = [
        await factory(redis_url=url, upstream=upstream, pod=f"pod-{i}", patient=True)
        for i in range(n)
    ]
    for sc in pods:
        sc.steady()  # a loaded machine must not lapse the staleness bound mid-test
        await until_acked(sc)
    return pods


@contextlib.asynccontextmanager
async def invalidator(url: str) -> AsyncIterator[Invalidator]:
    inv = Invalidator.from_url(url, CACHE, poll_s=POLL_S)
    try:
        yield inv
    finally:
        await inv.aclose()


async def l2_digest(url: str, tenant: str, prompt: str) -> str:
    """The digest L2 names the entry of ``prompt`` by (the X-Cache-Key of its hits).

    Waits (bounded) for the sidecar's background L2 write.
    """
    client = redis_from_url(url)
    try:
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            async for raw in client.scan_iter(match=entry_key(CACHE, tenant, "*")):
                key = raw.decode()
                value = await client.get(key)
                if value is not None and f'"{prompt}@v'.encode() in value:
                    return key.rpartition(":e:")[2]
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()
    raise AssertionError(f"no L2 entry for {prompt!r}")


async def purge(url: str, digest: str) -> tuple[int, int, int]:
    """A Key purge through the acknowledged path: (purge epoch, acks, expected)."""
    async with invalidator(url) as inv:
        epoch, at = await inv.purge(digest)
        result = await inv.await_acks(PURGE_SCOPE, epoch, timeout_s=ACK_TIMEOUT_S, started_at=at)
    assert result.completed, result
    return result.epoch, result.acks, result.expected


# ------------------------------------------------------------------ key purges


async def test_key_purge_drops_one_entry_from_l2_and_every_l1(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, any_redis: str
) -> None:
    redis_url = any_redis
    a, b = await fleet(sidecar_factory, redis_url, truth.url, 2)
    for prompt in ("q1", "q2"):
        assert await ask(a, prompt) == (1, "MISS")
        await l2_digest(redis_url, "acme", prompt)
        assert await ask(b, prompt) == (1, "HIT-L2")
        assert await ask(a, prompt) == (1, "HIT-L1")
    digest = await l2_digest(redis_url, "acme", "q1")
    truth.bump()
    assert await purge(redis_url, digest) == (1, 2, 2)
    # the purged entry: gone from both L1s and from L2, fetched again
    assert await ask(b, "q1") == (2, "MISS")
    assert (await ask(a, "q1"))[0] == 2
    # every other entry stays where it was
    assert await ask(a, "q2") == (1, "HIT-L1")
    assert await ask(b, "q2") == (1, "HIT-L1")
    status = (await a.admin.get("/status")).json()
    assert status["invalidation_epochs"] == {"purge": 1}
    assert status["purges"] == {"digests": 1, "l1_entries_dropped": 1, "l1_emptied": 0}
    assert a.server.control.purges_applied == 1


async def test_an_answer_fetched_before_the_purge_is_not_written_back(redis_url: str) -> None:
    digest = "ab" * 32
    before = (("cache", 0), ("tenant:acme", 0), ("model:m1", 0), (PURGE_SCOPE, 0))
    after = (*before[:3], (PURGE_SCOPE, 1))
    async with RedisL2.from_url(redis_url, CACHE, op_timeout_s=1.0) as l2:
        assert await l2.put("acme", digest, b"old answer", before)
        async with invalidator(redis_url) as inv:
            assert (await inv.purge(digest))[0] == 1  # delete + fence; nobody acked
        assert await l2.get("acme", digest, after) is None  # deleted
        assert not await l2.put("acme", digest, b"old answer", before)  # writer behind: refused
        assert await l2.get("acme", digest, before) is None  # reader behind: refused
        assert await l2.put("acme", digest, b"new answer", after)
        assert await l2.get("acme", digest, after) == b"new answer"  # the head did not move


async def test_no_read_after_a_completed_purge_is_older(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, redis_url: str
) -> None:
    pods = await fleet(sidecar_factory, redis_url, truth.url, 2)
    await ask(pods[0], "hot")
    digest = await l2_digest(redis_url, "acme", "hot")
    reads: list[tuple[float, int, str]] = []
    done: list[tuple[float, int]] = []
    stop = asyncio.Event()

    async def client(n: int) -> None:
        rng = random.Random(n)
        while not stop.is_set():
            started = time.perf_counter()
            version, tier = await ask(rng.choice(pods), "hot")
            reads.append((started, version, tier))

    async def purger() -> None:
        async with invalidator(redis_url) as inv:
            for _ in range(6):
                await asyncio.sleep(0.15)  # let the entry spread to L1 and L2 again
                guaranteed = truth.bump()
                epoch, at = await inv.purge(digest)
                result = await inv.await_acks(
                    PURGE_SCOPE, epoch, timeout_s=ACK_TIMEOUT_S, started_at=at
                )
                assert result.completed, result
                done.append((time.perf_counter(), guaranteed))

    clients = [asyncio.create_task(client(n)) for n in range(3)]
    await purger()
    stop.set()
    await asyncio.gather(*clients)
    stale = [
        (started, version, tier, guaranteed)
        for started, version, tier in reads
        for completed, guaranteed in done
        if started > completed and version < guaranteed
    ]
    assert not stale, f"{len(stale)} stale reads, first: {stale[0]}"
    assert {"HIT-L1", "MISS"} <= {tier for _, _, tier in reads}
    assert len(done) == 6


async def test_a_sidecar_that_missed_trimmed_purges_empties_its_l1(
    sidecar_factory: SidecarFactory,
    truth: VersionedUpstream,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (a,) = await fleet(sidecar_factory, redis_url, truth.url, 1)
    assert await ask(a, "kept") == (1, "MISS")
    assert await ask(a, "kept") == (1, "HIT-L1")
    monkeypatch.setattr(ops, "PURGE_LOG_MAX", 1)
    client = redis_from_url(redis_url)
    try:  # two purges logged, no announcement: the log keeps only the last
        await log_purge(client, CACHE, "01" * 32)
        await log_purge(client, CACHE, "02" * 32)
    finally:
        await client.aclose()
    for _ in range(1000):  # the epoch poll finds the new number (bounded: 20 s and more)
        if a.sidecar.tracker.epoch(PURGE_SCOPE) >= 2:
            break
        await asyncio.sleep(0.02)
    assert a.server.control.purge_gaps == 1
    assert (await a.admin.get("/status")).json()["purges"]["l1_emptied"] == 1
    assert await ask(a, "kept") == (1, "HIT-L2")  # L1 emptied, L2 untouched


# ------------------------------------------------------------------ namespaces


async def test_a_namespace_partitions_a_tenant_and_is_invalidated_alone(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, any_redis: str
) -> None:
    redis_url = any_redis
    a, b = await fleet(sidecar_factory, redis_url, truth.url, 2)
    for namespace in ("kb1", "kb2", None):  # three entries: same prompt, same tenant
        assert await ask(a, "q", namespace=namespace) == (1, "MISS")
    for namespace in ("kb1", "kb2", None):
        assert await ask(a, "q", namespace=namespace) == (1, "HIT-L1")
    truth.bump()
    async with invalidator(redis_url) as inv:
        result = await inv.invalidate(namespace_scope("acme", "kb1"), timeout_s=ACK_TIMEOUT_S)
    assert result.completed
    assert (result.acks, result.expected) == (2, 2)
    assert await ask(a, "q", namespace="kb1") == (2, "MISS")
    assert await ask(a, "q", namespace="kb2") == (1, "HIT-L1")
    assert await ask(a, "q") == (1, "HIT-L1")
    await l2_digest(redis_url, "acme", "q")
    assert await ask(b, "q", namespace="kb2") == (1, "HIT-L2")
    assert (await ask(b, "q", namespace="kb1"))[0] == 2
    # another tenant's namespace of the same name is another partition
    assert await ask(a, "q", tenant="other", namespace="kb1") == (2, "MISS")


async def test_the_namespace_header_is_a_flag_and_bad_values_are_refused(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, redis_url: str
) -> None:
    sc = await sidecar_factory(redis_url=redis_url, upstream=truth.url, namespace_header="X-KB")
    await until_acked(sc)
    first = await sc.chat("q", headers={"X-KB": "docs"})
    assert first.headers["x-cache"] == "MISS"
    assert (await sc.chat("q", headers={"X-KB": "docs"})).headers["x-cache"] == "HIT-L1"
    assert (await sc.chat("q", headers={"X-KB": "blog"})).headers["x-cache"] == "MISS"
    # the default header's name means nothing to this sidecar
    assert (await sc.chat("q", headers={"X-Cache-Namespace": "blog"})).headers["x-cache"] == "MISS"
    bad = await sc.chat("q", headers={"X-KB": "no/slashes"})
    assert bad.status_code == 400
    assert "X-KB" in bad.json()["error"]["message"]


async def test_a_lost_purge_notice_is_caught_up_by_the_poll(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, redis_url: str
) -> None:
    (a,) = await fleet(sidecar_factory, redis_url, truth.url, 1)
    assert await ask(a, "q") == (1, "MISS")
    digest = await l2_digest(redis_url, "acme", "q")
    assert await ask(a, "q") == (1, "HIT-L1")
    truth.bump()
    async with invalidator(redis_url) as inv:
        # CAS + log, delete + fence, and no announcement: the notice is "lost"
        client = redis_from_url(redis_url)
        try:
            epoch = await log_purge(client, CACHE, digest)
        finally:
            await client.aclose()
        assert inv.lean is not None
        assert await purge_fence(inv.lean, CACHE, digest, epoch) == 1
        result = await inv.await_acks(PURGE_SCOPE, epoch, timeout_s=ACK_TIMEOUT_S)
    assert result.completed
    assert await ask(a, "q") == (2, "MISS")


async def test_a_resumed_purge_does_not_purge_twice(redis_url: str) -> None:
    """An operator restart after the CAS: the digest is found logged, nothing advances again."""
    digest = "cd" * 32
    async with invalidator(redis_url) as inv:
        first, _, advanced = await inv.purge_to(digest, 1)
        assert (first, advanced) == (1, True)
        again, _, advanced = await inv.purge_to(digest, 1)
        assert (again, advanced) == (1, False)
        # another digest purged meanwhile does not stand in for this one
        other, _, _ = await inv.purge_to("ef" * 32, 2)
        assert other == 2
        third, _, advanced = await inv.purge_to(digest, 3)
        assert (third, advanced) == (3, True)
        assert await inv.current(PURGE_SCOPE) == 3
