"""Versioned, acknowledged invalidation against real Redis (standalone and a 3-node cluster).

Real in-process sidecars sit in front of a stand-in upstream whose answers
carry a *truth version* that the test moves forward right before each
invalidation (a "knowledge-base refresh"). What a user would notice:

* once an invalidation is acknowledged, no request that starts afterwards is
  answered with an older version, from any tier, even with writers, readers
  and several invalidators running at once (the checker);
* concurrent invalidators never lose a step;
* a lost notice or a dropped pub/sub connection is caught up by the poll;
  duplicated or reordered notices change nothing;
* a Redis restart never sends epochs backwards, and while Redis is away L1
  stops serving after the staleness bound;
* a sidecar paused with SIGSTOP is reported lagging, and the invalidation
  completes once it is resumed or gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.names import members_key
from cachefleet_common.contract.ops import advance_epoch, publish_epochs, read_acks, read_epochs
from cachefleet_common.epochs import tenant_scope
from cachefleet_e2e.services import RedisServer, free_port
from cachefleet_e2e.truth import Read, VersionedUpstream, stale_reads
from cachefleet_operator.invalidation import Invalidator
from tests.integration.conftest import RunningSidecar, SidecarFactory

pytestmark = [pytest.mark.redis]

CACHE = "test/cache"
#: Bound on waiting for acknowledgements in these tests, seconds.
ACK_TIMEOUT_S = 20.0  # generous: a loaded machine only waits longer
#: Bound on waiting for the clients' reads between invalidation rounds, seconds.
SPREAD_BOUND_S = 20.0
#: Ack polling interval of the test invalidators, seconds.
POLL_S = 0.05


async def ask(sc: RunningSidecar, prompt: str, tenant: str = "acme") -> tuple[int, str]:
    """(truth version in the answer, X-Cache) of one request."""
    resp = await sc.chat(prompt, tenant=tenant)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["version"]), resp.headers["x-cache"]


async def until_acked(sc: RunningSidecar, timeout_s: float = ACK_TIMEOUT_S) -> None:
    """Wait until the sidecar confirmed and acknowledged its epochs once."""
    deadline = time.monotonic() + timeout_s
    control = sc.server.control
    while time.monotonic() < deadline:
        if control.acks_written > 0 and sc.sidecar.tracker.fresh():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the sidecar never acknowledged its epochs")


@contextlib.asynccontextmanager
async def invalidator(url: str) -> AsyncIterator[Invalidator]:
    inv = Invalidator.from_url(url, CACHE, poll_s=POLL_S)
    try:
        yield inv
    finally:
        await inv.aclose()


async def fleet(
    factory: SidecarFactory,
    url: str,
    upstream: str,
    n: int,
    *,
    patient: bool = False,
    steady: bool = True,
) -> list[RunningSidecar]:
    """``n`` acknowledged pods; steady (a 60 s staleness bound) unless the test is about it."""
    pods = [
        await factory(redis_url=url, upstream=upstream, pod=f"pod-{i}", patient=patient)
        for i in range(n)
    ]
    for sc in pods:
        if steady:
            sc.steady()
        await until_acked(sc)
    return pods


# ------------------------------------------------------------------ basics


async def test_concurrent_invalidators_never_lose_a_step(any_redis: str) -> None:
    clients = [redis_from_url(any_redis) for _ in range(4)]
    try:

        async def bump_many(client: Any) -> list[int]:
            return [await advance_epoch(client, CACHE, "cache") for _ in range(10)]

        results = await asyncio.gather(*(bump_many(c) for c in clients))
        handed_out = sorted(itertools.chain.from_iterable(results))
        assert handed_out == list(range(1, 41))  # every step once, none lost
        assert await read_epochs(clients[0], CACHE) == {"cache": 40}
    finally:
        for client in clients:
            await client.aclose()


async def test_acknowledged_invalidation_hides_old_answers_on_every_pod(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, any_redis: str
) -> None:
    a, b = await fleet(sidecar_factory, any_redis, truth.url, 2, patient=True)
    assert await ask(a, "q") == (1, "MISS")
    await a.stored()
    assert await ask(b, "q") == (1, "HIT-L2")
    assert await ask(a, "q") == (1, "HIT-L1")
    truth.bump()
    async with invalidator(any_redis) as inv:
        result = await inv.invalidate("cache", timeout_s=ACK_TIMEOUT_S)
    assert result.completed
    assert (result.epoch, result.acks, result.expected) == (1, 2, 2)
    # (how long the acks took is reported; not bounded here: a loaded machine may be slow)
    assert result.propagation_s is not None
    assert 0 <= result.propagation_s <= ACK_TIMEOUT_S
    for sc in (a, b):
        version, _ = await ask(sc, "q")
        assert version == 2
    status = (await a.admin.get("/status")).json()
    assert status["invalidation_epochs"] == {"cache": 1}
    assert status["epochs_confirmed"] is True


async def test_tenant_scope_leaves_other_tenants_cached(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, any_redis: str
) -> None:
    (a,) = await fleet(sidecar_factory, any_redis, truth.url, 1)
    await ask(a, "q", tenant="t1")
    await ask(a, "q", tenant="t2")
    truth.bump()
    async with invalidator(any_redis) as inv:
        result = await inv.invalidate(tenant_scope("t1"), timeout_s=ACK_TIMEOUT_S)
    assert result.completed
    assert await ask(a, "q", tenant="t1") == (2, "MISS")
    assert await ask(a, "q", tenant="t2") == (1, "HIT-L1")


async def test_l2_refuses_a_reader_behind_the_fence(any_redis: str) -> None:
    """The epoch check is in the read's own round trip, whatever the reader knows."""
    from cachefleet_sidecar.cache.l2 import RedisL2

    old = (("cache", 0), ("tenant:acme", 0), ("model:m1", 0))
    async with RedisL2.from_url(any_redis, CACHE, op_timeout_s=1.0) as l2:
        assert await l2.put("acme", "ab" * 32, b"old answer", old)
        assert await l2.get("acme", "ab" * 32, old) == b"old answer"
        async with invalidator(any_redis) as inv:
            epoch, _ = await inv.advance("cache")  # CAS + fence; nobody acked
        assert epoch == 1
        assert await l2.get("acme", "ab" * 32, old) is None
        assert l2.counters.stale_refused == 1
        assert not await l2.put("acme", "cd" * 32, b"late write", old)
        new = (("cache", 1), ("tenant:acme", 0), ("model:m1", 0))
        # an entry only serves the epochs it was written under (it is dropped)
        assert not await l2.get("acme", "ab" * 32, new)
        assert await l2.get("acme", "ab" * 32, old) is None
        assert await l2.put("acme", "cd" * 32, b"fresh", new)
        assert await l2.get("acme", "cd" * 32, new) == b"fresh"
        # every scope of the vector is checked against the fence, not only the first
        refused = l2.counters.stale_refused
        async with invalidator(any_redis) as inv:
            assert (await inv.advance("model:m1"))[0] == 1
        assert await l2.get("acme", "cd" * 32, new) is None
        assert l2.counters.stale_refused == refused + 1
        assert not await l2.put("acme", "ef" * 32, b"late write", new)


# ------------------------------------------------------------- the checker


async def test_no_read_after_an_acknowledged_invalidation_is_older(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, any_redis: str
) -> None:
    pods = await fleet(sidecar_factory, any_redis, truth.url, 2, patient=True)
    reads: list[Read] = []
    # (acknowledged at, scope, truth version it guarantees within that scope)
    done: list[tuple[float, str, int]] = []
    stop = asyncio.Event()
    prompts = [f"p{i}" for i in range(4)]
    tenants = ["t1", "t2"]

    async def client(n: int) -> None:
        rng = random.Random(n)
        while not stop.is_set():
            sc = rng.choice(pods)
            started = time.perf_counter()
            tenant = rng.choice(tenants)
            version, tier = await ask(sc, rng.choice(prompts), tenant)
            reads.append(Read(started, tenant, version, tier))

    async def invalidate(scopes: list[str]) -> None:
        async with invalidator(any_redis) as inv:
            for scope in scopes:
                # let entries spread to L1 and L2 between rounds: a while, and at least a
                # few reads, however slow the machine
                await asyncio.sleep(0.2)
                seen = len(reads)
                deadline = time.monotonic() + SPREAD_BOUND_S
                while len(reads) < seen + 12:
                    assert time.monotonic() < deadline, "the clients stopped reading"
                    await asyncio.sleep(0.02)
                guaranteed = truth.bump()
                result = await inv.invalidate(scope, timeout_s=ACK_TIMEOUT_S)
                assert result.completed, result
                done.append((time.perf_counter(), scope, guaranteed))

    clients = [asyncio.create_task(client(n)) for n in range(3)]
    await asyncio.gather(
        invalidate(["cache", "tenant:t1", "model:m1", "cache", "tenant:t2", "cache"]),
        invalidate(["model:m1", "cache", "tenant:t1", "tenant:t2", "cache", "model:m1"]),
    )
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*clients)

    stale = stale_reads(reads, done)
    assert not stale, f"{len(stale)} stale reads, first: {stale[0]}"
    tiers = {r.tier for r in reads}
    assert {"HIT-L1", "HIT-L2", "MISS"} <= tiers, tiers  # every tier was exercised
    assert len(done) == 12


# ------------------------------------------------------------------ faults


async def test_lost_notice_and_dropped_pubsub_are_caught_up_by_the_poll(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, redis_url: str
) -> None:
    (a,) = await fleet(sidecar_factory, redis_url, truth.url, 1)
    client = redis_from_url(redis_url)
    try:
        # a notice that never comes: CAS without publishing
        epoch = await advance_epoch(client, CACHE, "cache")
        async with invalidator(redis_url) as inv:
            result = await inv.await_acks("cache", epoch, timeout_s=ACK_TIMEOUT_S)
            assert result.completed
            # No notice was published: only the sidecar's bounded poll can have acknowledged
            # (how long it took depends on the machine's load and is not bounded here).
            assert result.propagation_s is not None
            # the pub/sub connection dropped under the sidecar
            killed = await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            assert int(killed) >= 1
            result = await inv.invalidate("cache", timeout_s=ACK_TIMEOUT_S)
            assert result.completed
            assert result.epoch == 2
    finally:
        await client.aclose()
    assert a.sidecar.tracker.known == {"cache": 2}


async def test_duplicated_and_reordered_notices_change_nothing(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, redis_url: str
) -> None:
    (a,) = await fleet(sidecar_factory, redis_url, truth.url, 1)
    async with invalidator(redis_url) as inv:
        for _ in range(3):
            assert (await inv.invalidate("cache", timeout_s=ACK_TIMEOUT_S)).completed
    await ask(a, "q")
    assert await ask(a, "q") == (1, "HIT-L1")
    version = a.sidecar.keying.scope_version
    client = redis_from_url(redis_url)
    try:
        for epochs in ({"cache": 3}, {"cache": 3}, {"cache": 1}, {"cache": 2}):
            await publish_epochs(client, CACHE, epochs)
        await asyncio.sleep(0.3)
        acks = await read_acks(client, CACHE)
    finally:
        await client.aclose()
    assert a.sidecar.tracker.known == {"cache": 3}
    assert a.sidecar.keying.scope_version == version  # keys untouched
    assert acks["pod-0"].epochs == {"cache": 3}
    assert await ask(a, "q") == (1, "HIT-L1")


async def test_redis_restart_never_sends_epochs_back_and_l1_stops_when_unconfirmed(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream
) -> None:
    with RedisServer() as redis:
        (a,) = await fleet(sidecar_factory, redis.url, truth.url, 1, steady=False)
        async with invalidator(redis.url) as inv:
            for _ in range(2):
                assert (await inv.invalidate("cache", timeout_s=ACK_TIMEOUT_S)).completed
        await ask(a, "q")
        assert await ask(a, "q") == (1, "HIT-L1")
        redis.kill()
        await asyncio.sleep(a.sidecar.tracker.bound_s + 0.3)
        # unconfirmed for longer than the bound: L1 is bypassed, never stale
        assert not a.sidecar.tracker.fresh()
        assert await ask(a, "q") == (1, "MISS")
        redis.restart()  # no persistence: the epoch hash is gone
        client = redis_from_url(redis.url)
        try:
            deadline = time.monotonic() + ACK_TIMEOUT_S
            while await read_epochs(client, CACHE) != {"cache": 2}:
                assert time.monotonic() < deadline, "the sidecar did not restore the epochs"
                await asyncio.sleep(0.05)
            assert await advance_epoch(client, CACHE, "cache") == 3
        finally:
            await client.aclose()
        assert a.server.control.restores >= 1
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while not a.sidecar.tracker.fresh() or a.sidecar.tracker.known != {"cache": 3}:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)


# ------------------------------------------------------- a paused sidecar


@pytest.fixture
def sidecar_process(truth: VersionedUpstream, redis_url: str) -> Iterator[subprocess.Popen[bytes]]:
    port, admin = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cachefleet_operator.cli",
            "sidecar",
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream",
            truth.url,
            "--redis-url",
            redis_url,
            "--cache",
            CACHE,
            "--pod",
            "paused-pod",
            "--trusted-proxies",
            "127.0.0.1/32",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "CACHEFLEET_ADMIN_LISTEN": f"127.0.0.1:{admin}"},
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(5)


async def test_paused_sidecar_is_reported_lagging_then_completes(
    sidecar_process: subprocess.Popen[bytes], redis_url: str
) -> None:
    client = redis_from_url(redis_url)
    try:
        deadline = time.monotonic() + 10.0
        while "paused-pod" not in await read_acks(client, CACHE):
            assert time.monotonic() < deadline, "the sidecar process never acknowledged"
            await asyncio.sleep(0.05)
        async with invalidator(redis_url) as inv:
            first = await inv.invalidate("cache", timeout_s=ACK_TIMEOUT_S)
            assert (first.completed, first.acks) == (True, 1)

            sidecar_process.send_signal(signal.SIGSTOP)
            paused = await inv.invalidate("cache", timeout_s=1.0)
            assert not paused.completed
            assert paused.lagging == ["paused-pod"]

            sidecar_process.send_signal(signal.SIGCONT)  # resumed: it catches up
            resumed = await inv.await_acks("cache", paused.epoch, timeout_s=ACK_TIMEOUT_S)
            assert resumed.completed
            assert resumed.acks == 1

            sidecar_process.send_signal(signal.SIGSTOP)
            paused = await inv.invalidate("cache", timeout_s=0.5)
            assert paused.lagging == ["paused-pod"]
            # gone: its heartbeat expires (made to expire now instead of in 15 s)
            await client.zadd(members_key(CACHE), {"paused-pod": time.time() - 1})
            gone = await inv.await_acks("cache", paused.epoch, timeout_s=ACK_TIMEOUT_S)
            assert gone.completed
            assert gone.expected == 0
    finally:
        await client.aclose()
