"""Spec: every resource a client or the model server can make the sidecar hold has a bound.

Black-box over real sockets (raw where the client must misbehave), against
the stand-in model server. Timeouts are configured short and asserted with
generous safety margins: a test checks what happened, never how fast.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_sidecar.http.server import FEED_SLICE

from .conftest import RunningSidecar, SidecarFactory
from .test_sidecar import CHAT, metric

#: Upper bound for anything that should happen "soon" (a loaded 2-core CI box).
SAFETY_S = 15.0
SMALL = {
    "max_url_bytes": 1024,
    "max_header_bytes": 2048,
    "max_body_bytes": 4096,
}


def port_of(sc: RunningSidecar) -> int:
    return int(sc.url.rsplit(":", 1)[1])


async def connect(sc: RunningSidecar) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port_of(sc))


async def read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything until the sidecar closes (or half-closes) the connection."""
    async with asyncio.timeout(SAFETY_S):
        return await reader.read()


async def exchange(sc: RunningSidecar, data: bytes) -> bytes:
    reader, writer = await connect(sc)
    try:
        writer.write(data)
        await writer.drain()
        return await read_all(reader)
    finally:
        writer.close()


def status(raw: bytes) -> int:
    assert raw.startswith(b"HTTP/1.1 "), raw[:80]
    return int(raw[9:12])


def chat_request(content: str = "hi", **extra: Any) -> bytes:
    body = json.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": content}], **extra}
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Tenant-ID: acme\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


# ------------------------------------------------------ sizes: 414 / 431 / 413
async def test_a_long_request_target_gets_414(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(**SMALL)
    raw = await exchange(sc, b"GET /" + b"a" * 2000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status(raw) == 414
    assert b"request target longer than 1024 bytes" in raw
    assert sum(upstream.calls.values()) == 0
    text = (await sc.admin.get("/metrics")).text
    assert metric(text, "cachefleet_refused_requests_total", status="414") == 1


async def test_a_large_header_block_gets_431(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(**SMALL)
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 90) for i in range(40))
    assert status(await exchange(sc, b"GET / HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")) == 431
    tiny = b"".join(b"a%d: b\r\n" % i for i in range(300))  # few bytes, many objects
    assert status(await exchange(sc, b"GET / HTTP/1.1\r\nHost: x\r\n" + tiny + b"\r\n")) == 431
    # One header line that never ends is refused once it passes the bound,
    # without waiting for the rest (the client here never sends it).
    reader, writer = await connect(sc)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 200_000)
    raw = await read_all(reader)
    writer.close()
    assert status(raw) == 431
    assert sum(upstream.calls.values()) == 0


async def test_a_large_body_gets_413_before_it_is_sent(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(**SMALL)
    reader, writer = await connect(sc)
    # Only the head: the sidecar answers from Content-Length alone.
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n"
    )
    raw = await read_all(reader)
    writer.close()
    assert status(raw) == 413
    assert b"request body larger than 4096 bytes" in raw


async def test_a_chunked_body_over_the_limit_gets_413(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(**SMALL)
    chunk = b"1000\r\n" + b"x" * 4096 + b"\r\n"
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert status(await exchange(sc, head + chunk * 3)) == 413
    assert sum(upstream.calls.values()) == 0


async def test_a_client_that_sends_its_whole_body_still_reads_its_413(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(**SMALL)
    resp = await sc.client.post("/v1/chat/completions", content=b"x" * 200_000)
    assert resp.status_code == 413
    # The sidecar is fine for everyone else.
    assert (await sc.chat("after")).status_code == 200


# ------------------------------------------------------------- memory budget
async def test_request_bodies_share_one_memory_budget(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(max_body_bytes=48_000, body_memory_bytes=64_000)
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Tenant-ID: acme\r\nContent-Length: 40000\r\n\r\n"
    slow_reader, slow = await connect(sc)
    slow.write(head + b"a" * 1000)  # holds 40 kB of the budget while it dawdles
    await slow.drain()
    for _ in range(1000):  # until the sidecar has read the head and reserved the body
        if sc.server.limiter.body_bytes:
            break
        await asyncio.sleep(0.01)
    refused = await exchange(sc, head + b"b" * 40_000)
    assert status(refused) == 503
    assert b"memory budget" in refused
    assert b"retry-after" in refused.lower()
    slow.write(b"a" * 39_000)  # the first body completes and is served
    await slow.drain()
    async with asyncio.timeout(SAFETY_S):
        first = await slow_reader.readuntil(b"\r\n\r\n")
    assert status(first) == 200
    slow.close()
    # Its budget came back: the same large body is accepted now.
    resp = await sc.client.post("/echo", content=b"c" * 40_000, headers={"X-Tenant-ID": "acme"})
    assert resp.status_code == 200
    assert resp.json()["body"] == "c" * 40_000
    for _ in range(400):
        if sc.server.limiter.body_bytes == 0:
            break
        await asyncio.sleep(0.05)
    assert sc.server.limiter.body_bytes == 0


async def test_a_large_body_is_charged_for_both_copies_it_holds(
    sidecar_factory: SidecarFactory,
) -> None:
    """Bodies of 64 KiB and more are charged twice (the request's copy and the upstream
    send buffer's): two 100 kB bodies fill a 450 kB budget that three would fit raw,
    while a small body is still charged only its size."""
    from cachefleet_sidecar.http.server import LARGE_BODY_BYTES

    sc = await sidecar_factory(max_body_bytes=200_000, body_memory_bytes=450_000)
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Tenant-ID: acme\r\nContent-Length: %d\r\n\r\n"
    held = []
    for _ in range(2):  # each holds its reservation while it dawdles
        reader, writer = await connect(sc)
        writer.write(head % 100_000 + b"a" * 1000)
        await writer.drain()
        held.append((reader, writer))
    for _ in range(1000):  # until the sidecar has read both heads
        if sc.server.limiter.body_bytes >= 400_000:
            break
        await asyncio.sleep(0.01)
    assert sc.server.limiter.body_bytes == 400_000
    refused = await exchange(sc, head % 100_000 + b"b" * 100_000)
    assert status(refused) == 503
    assert b"memory budget" in refused
    small = LARGE_BODY_BYTES // 2  # 400 kB + 32 kB fits: charged once
    closing = head.replace(b"Host: x", b"Host: x\r\nConnection: close")
    assert status(await exchange(sc, closing % small + b"c" * small)) == 200
    chunked = (  # the same charge without Content-Length: refused once it grows large
        b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Tenant-ID: acme\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (90_000, b"d" * 90_000)
    )
    assert status(await exchange(sc, chunked)) == 503
    for reader, writer in held:  # the held bodies complete and are served
        writer.write(b"a" * 99_000)
        await writer.drain()
        async with asyncio.timeout(SAFETY_S):
            assert status(await reader.readuntil(b"\r\n\r\n")) == 200
        writer.close()
    for _ in range(400):
        if sc.server.limiter.body_bytes == 0:
            break
        await asyncio.sleep(0.05)
    assert sc.server.limiter.body_bytes == 0


# --------------------------------------------------------------- pipelining
async def test_a_pipelining_client_that_does_not_read_is_bounded(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(max_pipelined=4)
    # 300 answers of 200 kB: far more than any kernel's socket buffers hold.
    upstream.pad_bytes = 200_000
    one = chat_request("pipelined", temperature=0.7)  # not cacheable: each goes upstream
    count = 300
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port_of(sc)))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
    sending = asyncio.create_task(writer.drain())
    writer.write(one * count)

    def conn_state() -> tuple[int, int, int]:
        (conn,) = [c for c in sc.server.connections if c.transport is not None]
        assert conn.transport is not None
        return len(conn.pending), conn.transport.get_write_buffer_size(), len(conn._stash)

    # Wait until the sidecar stops taking requests (the client reads nothing).
    calls, still = -1, 0
    async with asyncio.timeout(SAFETY_S):
        while still < 10:
            await asyncio.sleep(0.1)
            now = upstream.calls[CHAT]
            still = still + 1 if now == calls else 0
            calls = now
    pending, buffered, stashed = conn_state()
    assert calls < count  # it stopped: nothing close to all of them went upstream
    assert pending <= 4 + FEED_SLICE // len(one) + 1
    assert buffered < 4 * 1024 * 1024
    assert stashed <= 1
    # Once the client reads, every answer arrives, in order.
    answers = 0
    async with asyncio.timeout(SAFETY_S * 4):
        while answers < count:
            await reader.readuntil(b"HTTP/1.1 200 OK\r\n")
            answers += 1
    await sending
    writer.close()
    assert upstream.calls[CHAT] == count


# ----------------------------------------------------------------- timeouts
TIMEOUTS = {"idle_timeout_s": 0.5, "header_timeout_s": 0.5, "body_timeout_s": 0.5}


async def test_an_idle_keep_alive_connection_is_closed(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(**TIMEOUTS)
    reader, writer = await connect(sc)
    writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Tenant-ID: acme\r\n\r\n")
    async with asyncio.timeout(SAFETY_S):
        head = await reader.readuntil(b"\r\n\r\n")
    assert status(head) == 200
    length = int(
        next(
            line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        ).split(b":")[1]
    )
    await reader.readexactly(length)
    assert await read_all(reader) == b""  # closed by the sidecar, nothing more sent
    writer.close()


async def test_slow_headers_get_408_even_when_bytes_keep_trickling(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(**TIMEOUTS)
    reader, writer = await connect(sc)
    writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n")

    async def trickle() -> None:
        for i in range(200):  # would take 20 s: the head deadline is 0.5 s in total
            writer.write(b"X-%d: y\r\n" % i)
            await asyncio.sleep(0.1)

    dripping = asyncio.create_task(trickle())
    try:
        raw = await read_all(reader)
    finally:
        dripping.cancel()
        writer.close()
    assert status(raw) == 408
    assert not dripping.done() or dripping.cancelled()


async def test_half_sent_requests_do_not_hold_connections(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    # The idle timeout is not what this is about: a loaded machine may take longer than
    # 0.5 s to open the 20 connections, and an idle one is closed without a 408.
    sc = await sidecar_factory(**{**TIMEOUTS, "idle_timeout_s": SAFETY_S * 4})
    idle = [await connect(sc) for _ in range(20)]
    for i, (_, w) in enumerate(idle):
        # Half a head, or a head and half a body.
        w.write(
            b"GET / HTTP/1.1\r\nHo"
            if i % 2
            else b"POST /echo HTTP/1.1\r\nContent-Length: 9\r\n\r\nabc"
        )
    results = await asyncio.gather(*(read_all(r) for r, _ in idle))
    assert all(status(raw) == 408 for raw in results)
    for _, w in idle:
        w.close()
    for _ in range(400):
        if not sc.server.connections:
            break
        await asyncio.sleep(0.05)
    assert len(sc.server.connections) <= 1  # httpx's keep-alive one at most
    assert (await sc.chat("still serving")).status_code == 200


async def test_a_client_that_stops_reading_its_answer_is_dropped(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(send_timeout_s=0.5)
    upstream.pad_bytes = 32_000_000  # relayed as it comes; more than any socket buffers hold
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port_of(sc)))
    sock.sendall(chat_request("never read", temperature=0.7))
    for _ in range(int(SAFETY_S / 0.05)):  # its connection goes away: it held the answer
        await asyncio.sleep(0.05)
        if not any(c.busy for c in sc.server.connections):
            break
    assert not any(c.busy for c in sc.server.connections)
    sock.close()
    text = (await sc.admin.get("/metrics")).text
    assert metric(text, "cachefleet_unread_dropped_connections_total") == 1
    upstream.pad_bytes = 0
    assert (await sc.chat("others are served")).status_code == 200


# ------------------------------------------------------------ largest entry
async def test_an_answer_larger_than_the_largest_entry_is_passed_through(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(max_entry_bytes=64 * 1024)
    upstream.pad_bytes = 200_000
    first = await sc.chat("big")
    second = await sc.chat("big")
    assert first.status_code == second.status_code == 200
    assert len(first.content) > 200_000
    assert first.headers["x-cache"] == second.headers["x-cache"] == "MISS"
    assert upstream.calls[CHAT] == 2
    upstream.pad_bytes = 0
    await sc.chat("small")
    assert (await sc.chat("small")).headers["x-cache"] == "HIT-L1"
    text = (await sc.admin.get("/metrics")).text
    assert metric(text, "cachefleet_cache_faults_total", kind="entry_too_large") == 2


@pytest.mark.redis
async def test_redis_gets_only_entries_up_to_its_own_limit(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, redis_url: str
) -> None:
    limits = {"redis_url": redis_url, "l2_max_entry_bytes": 16 * 1024}
    pod_a = (await sidecar_factory(pod="pod-a", patient=True, **limits)).steady()
    await pod_a.confirmed()  # L1 serves only once the epochs are confirmed
    upstream.pad_bytes = 50_000
    await pod_a.chat("medium")
    assert (await pod_a.chat("medium")).headers["x-cache"] == "HIT-L1"  # L1 keeps it
    upstream.pad_bytes = 0
    await pod_a.chat("tiny")
    await pod_a.stored()  # L2 writes are in the background
    pod_b = await sidecar_factory(pod="pod-b", patient=True, **limits)
    assert (await pod_b.chat("medium")).headers["x-cache"] == "MISS"  # never in Redis
    assert (await pod_b.chat("tiny")).headers["x-cache"] == "HIT-L2"


# ----------------------------------------------------------------- upstream
async def test_a_silent_upstream_gets_one_call_and_one_timeout(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(upstream_timeout_s=0.5)
    sc.sidecar.upstream.read_timeout_s = 20.0  # the warm-up: a loaded machine must not time it out
    assert (await sc.chat("warm the keep-alive connection")).status_code == 200
    sc.sidecar.upstream.read_timeout_s = 0.5
    upstream.default_latency_s = 4.0
    resp = await sc.chat("silent")
    # Answered on the sidecar's deadline, not the upstream's (which would be a 200):
    # the outcome says so, however long a loaded machine took to get there.
    assert resp.status_code == 504
    assert "upstream timeout" in resp.json()["error"]["message"]
    await asyncio.sleep(1.5)  # long enough for a resend to have arrived
    assert upstream.calls[CHAT] == 2  # the warm-up and the silent one: never resent


async def test_a_post_the_upstream_dropped_is_not_resent(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory()
    assert (await sc.chat("warm")).status_code == 200
    upstream.drop_next = 1  # reads the request, closes without an answer
    resp = await sc.chat("dropped")
    assert resp.status_code == 502
    assert upstream.calls[CHAT] == 2
    assert (await sc.chat("dropped")).status_code == 200  # the next one is fine


def test_flags_for_every_limit() -> None:
    from cachefleet_sidecar.config import parse_args

    cfg = parse_args(
        [
            "--max-url-bytes=2Ki",
            "--max-header-bytes=8Ki",
            "--max-body-bytes=1Mi",
            "--max-body-memory=64Mi",
            "--max-pipelined=8",
            "--idle-timeout=30",
            "--header-timeout=5",
            "--body-timeout=20",
            "--send-timeout=40",
            "--max-entry-bytes=2Mi",
            "--l2-max-entry-bytes=512Ki",
        ]
    )
    assert (
        cfg.http.limits.max_url_bytes,
        cfg.http.limits.max_header_bytes,
        cfg.http.limits.max_body_bytes,
    ) == (2048, 8192, 1 << 20)
    assert (cfg.http.limits.body_memory_bytes, cfg.http.limits.max_pipelined) == (64 << 20, 8)
    assert (
        cfg.http.limits.idle_timeout_s,
        cfg.http.limits.header_timeout_s,
        cfg.http.limits.body_timeout_s,
    ) == (30, 5, 20)
    assert (
        cfg.http.limits.send_timeout_s,
        cfg.caching.max_entry_bytes,
        cfg.caching.l2_max_entry_bytes,
    ) == (
        40,
        2 << 20,
        512 << 10,
    )
    with pytest.raises(SystemExit):
        parse_args(["--idle-timeout=0"])
    with pytest.raises(SystemExit):
        parse_args(["--max-pipelined=0"])


async def test_the_key_memo_is_bounded_in_bytes(sidecar: RunningSidecar) -> None:
    from cachefleet_sidecar.cache.keying import KEY_MEMO_MAX_BYTES

    core = sidecar.sidecar.keying
    filler = "x" * 200_000
    for i in range(400):  # 400 distinct 200 kB bodies: ~160 MB of keys if all were kept
        raw = json.dumps({"model": "m", "input": f"{filler}{i}"}).encode()
        assert not isinstance(core.key_for("acme", "embeddings", b"", raw), str)
        assert core._key_memo_bytes <= KEY_MEMO_MAX_BYTES
    assert 0 < len(core._key_memo) < 400


async def test_a_body_too_large_to_key_is_forwarded_uncached(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    raw = json.dumps({"model": "m1", "input": "y" * (5 * 1024 * 1024)}).encode()
    for _ in range(2):
        resp = await sidecar.client.post(
            "/v1/embeddings", content=raw, headers={"X-Tenant-ID": "acme"}
        )
        assert resp.status_code == 200
        assert resp.headers["x-cache"] == "BYPASS"
    assert upstream.calls["/v1/embeddings"] == 2


async def test_trailers_are_never_request_headers(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    body = json.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": "t"}], "temperature": 0}
    ).encode()
    raw = await exchange(
        sidecar,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n%x\r\n%s\r\n0\r\nX-Tenant-ID: victim\r\n\r\n"
        % (len(body), body),
    )
    assert status(raw) == 403  # no tenant header: the trailer does not count
    assert upstream.calls[CHAT] == 0


async def test_a_get_is_retried_once_where_a_post_is_not(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    tenant = {"X-Tenant-ID": "acme"}  # identity applies to every path
    assert (await sidecar.client.get("/echo", headers=tenant)).status_code == 200
    upstream.drop_next = 1
    again = await sidecar.client.get("/echo", headers=tenant)
    assert again.status_code == 200  # safe to repeat: sent again on a fresh connection
    assert upstream.calls["/echo"] == 3


async def test_an_answered_body_is_not_held_by_its_idle_connection(
    sidecar: RunningSidecar,
) -> None:
    """A large body arrives in many reads; once answered, its keep-alive connection
    holds none of it (the budget is given back, so the memory must be too)."""
    import gc
    import tracemalloc

    size, conns = 2_000_000, 4
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Tenant-ID: acme\r\nContent-Length: %d\r\n\r\n"
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        streams = [await connect(sidecar) for _ in range(conns)]
        for i, (reader, writer) in enumerate(streams):
            writer.write(head % size)
            for _ in range(size // 100_000):  # many reads, so the chunks are joined
                writer.write(b"%d" % i * 100_000)
                await writer.drain()
            async with asyncio.timeout(SAFETY_S):
                answer = await reader.readuntil(b"\r\n\r\n")
                assert status(answer) == 200
                length = int(answer.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
        for _ in range(400):  # the budget comes back once each answer is written
            if sidecar.server.limiter.body_bytes == 0:
                break
            await asyncio.sleep(0.05)
        assert sidecar.server.limiter.body_bytes == 0
        gc.collect()  # what is still reachable, not garbage waiting for a collection
        held = tracemalloc.get_traced_memory()[0] - base
        # All four connections are still open: kept chunks would be 8 MB.
        assert held < size * conns // 4, held
    finally:
        tracemalloc.stop()
        for _, writer in streams:
            writer.close()
