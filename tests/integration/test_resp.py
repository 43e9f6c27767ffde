"""The lean RESP client against real redis-server: pipelining, scripts, faults, cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from cachefleet_common import resp
from cachefleet_common.contract.clients import resp_client
from cachefleet_e2e.services import RedisCluster, RedisServer, redis_command

INCR_BY_LUA = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A private redis-server this test may kill, pause and restart."""
    with RedisServer() as server:
        yield server


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[resp.RespClient]:
    c = resp_client(redis_url, command_timeout_s=5.0)
    yield c
    await c.aclose()


async def until(predicate: object, timeout_s: float = 10.0) -> None:
    """Poll an async predicate (a safety net, not a speed bound)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if await predicate():  # type: ignore[operator]
                return
        except resp.RespError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached within {timeout_s}s")


@pytest.mark.redis
async def test_concurrent_commands_share_one_connection_and_writes(
    client: resp.RespClient,
) -> None:
    await client.connect()
    node = client.nodes[0]
    writes_before = node.writes
    n = 500
    results = await asyncio.gather(
        *(client.execute("SET", f"k{i}", f"v{i}") for i in range(n)),
        *(client.execute("INCRBY", "counter", i) for i in range(n)),
    )
    assert results[:n] == [b"OK"] * n
    # Replies are matched to their callers in order: each INCRBY saw the running sum.
    assert results[n:] == [sum(range(i + 1)) for i in range(n)]
    values = await asyncio.gather(*(client.execute("GET", f"k{i}") for i in range(n)))
    assert values == [f"v{i}".encode() for i in range(n)]
    assert node.connects == 1
    # 1500 commands issued in the same loop iterations went out in a handful of writes.
    assert node.writes - writes_before <= 10


@pytest.mark.redis
async def test_error_reply_is_a_reply_error_and_the_pipeline_stays_in_step(
    client: resp.RespClient,
) -> None:
    await client.execute("SET", "s", "text")
    bad, good = await asyncio.gather(
        client.execute("INCR", "s"), client.execute("GET", "s"), return_exceptions=True
    )
    assert isinstance(bad, resp.ReplyError)
    assert bad.code == "ERR"
    assert good == b"text"


@pytest.mark.redis
async def test_a_pipeline_is_one_write_with_a_reply_each_and_errors_as_items(
    client: resp.RespClient,
) -> None:
    await client.connect()
    await client.execute("SET", "s", "text")
    node = client.nodes[0]
    writes_before = node.writes
    pack = resp.pack_command
    replies = await client.pipeline(
        "s", [pack(("GET", "s")), pack(("INCR", "s")), pack(("HMGET", "h", "a", "b"))]
    )
    assert node.writes - writes_before == 1
    assert replies[0] == b"text"
    assert isinstance(replies[1], resp.ReplyError)
    assert replies[1].code == "ERR"
    assert replies[2] == [None, None]
    # the connection stays in step after an error item
    assert await client.execute("GET", "s") == b"text"


@pytest.mark.redis
async def test_script_is_loaded_again_after_script_flush(client: resp.RespClient) -> None:
    script = resp.Script(INCR_BY_LUA)
    await client.load_scripts([script])
    assert await client.run_script(script, ["n"], [2]) == 2
    assert client.script_reloads == 0
    assert await client.execute("SCRIPT", "FLUSH") == b"OK"
    results = await asyncio.gather(*(client.run_script(script, ["n"], [1]) for _ in range(5)))
    assert sorted(results) == [3, 4, 5, 6, 7]
    assert client.script_reloads >= 1


@pytest.mark.redis
async def test_acl_user_and_wrong_password(redis_url: str, redis_server: RedisServer) -> None:
    reply = redis_command(
        redis_server.port, "ACL", "SETUSER", "resp-user", "reset", "on", ">pw-1", "~*", "+@all"
    )
    assert reply.startswith(b"+OK"), reply
    try:
        ok = resp_client(redis_url.replace("redis://", "redis://resp-user:pw-1@"))
        bad = resp_client(redis_url.replace("redis://", "redis://resp-user:wrong@"))
        try:
            assert await ok.execute("ACL", "WHOAMI") == b"resp-user"
            with pytest.raises(resp.ConnectionLost, match="WRONGPASS"):
                await bad.execute("PING")
        finally:
            await ok.aclose()
            await bad.aclose()
    finally:
        redis_command(redis_server.port, "ACL", "DELUSER", "resp-user")


@pytest.mark.redis
async def test_killed_server_fails_fast_and_restart_is_picked_up(own_redis: RedisServer) -> None:
    client = resp_client(own_redis.url, command_timeout_s=5.0)
    script = resp.Script(INCR_BY_LUA)
    try:
        assert await client.run_script(script, ["n"], [1]) == 1
        own_redis.kill()
        with pytest.raises(resp.ConnectionLost) as lost:
            await client.execute("GET", "n")
        # refused at once, not after the 5 s deadline: that would be a CommandTimeout, or
        # a connect that "timed out" (the outcome says which, however loaded the machine)
        assert not isinstance(lost.value, resp.CommandTimeout)
        assert "timed out" not in str(lost.value)
        own_redis.restart()

        async def back() -> bool:
            return await client.execute("PING", timeout_s=1.0) == b"PONG"

        await until(back)
        # the restarted server lost its scripts: NOSCRIPT is handled
        assert await client.run_script(script, ["n"], [5]) == 5
        assert client.nodes[0].connects >= 2
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_paused_server_times_out_then_replies_stay_matched(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not about stalls: a loaded machine may keep the server paused past the 1 s stall
    # bound, and the connection made again would not show the late reply being dropped.
    monkeypatch.setattr(resp, "STALL_S", 60.0)
    client = resp_client(own_redis.url, command_timeout_s=5.0)
    try:
        await client.execute("SET", "a", "A")
        await client.execute("SET", "b", "B")
        own_redis.pause()
        with pytest.raises(resp.CommandTimeout):
            await client.execute("GET", "a", timeout_s=0.1)
        own_redis.resume()
        # The late reply to GET a is dropped, not handed to the next caller.
        assert await client.execute("GET", "b", timeout_s=5.0) == b"B"
        assert client.nodes[0].connects == 1
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_each_waiting_command_keeps_its_own_deadline(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One timer per connection: a short deadline behind a long one still fires on time,
    # and the long one is still answered once the server is back. (Not about stalls: a
    # loaded machine may keep the server paused past the 1 s stall bound.)
    monkeypatch.setattr(resp, "STALL_S", 60.0)
    client = resp_client(own_redis.url, command_timeout_s=5.0)
    try:
        await client.execute("SET", "a", "A")
        own_redis.pause()
        long = asyncio.ensure_future(client.execute("GET", "a", timeout_s=30.0))
        await asyncio.sleep(0)
        t0 = time.monotonic()
        with pytest.raises(resp.CommandTimeout):
            await client.execute("GET", "a", timeout_s=0.1)
        assert time.monotonic() - t0 < 25.0  # not held to the long command's deadline
        assert not long.done()
        own_redis.resume()
        assert await long == b"A"
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_silent_connection_is_dropped_and_made_again(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resp, "STALL_S", 0.2)
    client = resp_client(own_redis.url)
    try:
        assert await client.execute("PING") == b"PONG"
        own_redis.pause()
        for _ in range(3):  # 0.1 s each: past the 0.2 s stall bound
            with pytest.raises(resp.CommandTimeout):
                await client.execute("PING", timeout_s=0.1)
        assert client.nodes[0].stalls >= 1
        own_redis.resume()

        async def back() -> bool:
            return await client.execute("PING", timeout_s=1.0) == b"PONG"

        await until(back)
        assert client.nodes[0].connects >= 2
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_subscriber_receives_and_resubscribes_after_restart(own_redis: RedisServer) -> None:
    got: list[bytes] = []
    subscribed = asyncio.Event()
    client = resp_client(own_redis.url)
    settings = client.settings
    sub = resp.Subscriber(
        settings, ["chan"], lambda _c, data: got.append(data), on_subscribed=subscribed.set
    )
    try:
        assert await sub.start()
        await asyncio.wait_for(subscribed.wait(), 20.0)
        assert await client.execute("PUBLISH", "chan", "one") == 1
        await until(lambda: _true(got == [b"one"]))
        own_redis.restart()
        subscribed.clear()
        deadline = asyncio.get_running_loop().time() + 10.0
        while not subscribed.is_set():
            assert asyncio.get_running_loop().time() < deadline, "never subscribed again"
            await sub.keep_alive(asyncio.get_running_loop().time() + 1.0)
            await asyncio.sleep(0.05)

        async def delivered() -> bool:
            await client.execute("PUBLISH", "chan", "two", timeout_s=1.0)
            return b"two" in got

        await until(delivered)
    finally:
        await sub.aclose()
        await client.aclose()


async def _true(value: bool) -> bool:
    return value


# ----------------------------------------------------------------- cluster


@pytest.mark.redis_cluster
async def test_cluster_routes_by_slot_and_follows_moved(cluster_url: str) -> None:
    client = resp_client(cluster_url, command_timeout_s=5.0)
    try:
        await client.connect()
        assert client.refreshes == 1
        owners = {client.address_for(f"{{t{i}}}:k") for i in range(64)}
        assert len(owners) == 3
        await asyncio.gather(
            *(client.execute("SET", f"{{t{i}}}:k", i, key=f"{{t{i}}}:k") for i in range(64))
        )
        assert client.moved == 0  # key_slot agrees with the servers' own slots
        # A wrong map (everything on one node): MOVED replies put each command right.
        one = client.address_for("{t0}:k")
        client._slots = [one] * resp.SLOTS
        values = await asyncio.gather(
            *(client.execute("GET", f"{{t{i}}}:k", key=f"{{t{i}}}:k") for i in range(64))
        )
        assert values == [str(i).encode() for i in range(64)]
        assert client.moved > 0
        await until(lambda: _true(len({client.address_for(f"{{t{i}}}:k") for i in range(64)}) == 3))
        # A pipeline follows MOVED as a whole (its commands share a slot).
        client._slots = [one] * resp.SLOTS
        moved = client.moved
        pack = resp.pack_command
        for i in range(64):
            key = f"{{t{i}}}:k"
            get, missing = await client.pipeline(
                key, [pack(("GET", key)), pack(("GET", f"{{t{i}}}:other"))]
            )
            assert (get, missing) == (str(i).encode(), None)
        assert client.moved > moved
    finally:
        await client.aclose()


@pytest.mark.redis_cluster
async def test_cluster_follows_ask_during_a_slot_migration(
    cluster_url: str, redis_cluster: RedisCluster
) -> None:
    client = resp_client(cluster_url, command_timeout_s=5.0)
    key = "{ask-me}:k"
    slot = resp.key_slot(key)
    try:
        await client.connect()
        source = client.address_for(key)
        target = next(n.address for n in client.nodes if n.address != source)
        ids = {
            a: redis_command(a[1], "CLUSTER", "MYID").split(b"\r\n")[1].decode()
            for a in (source, target)
        }
        assert redis_command(
            target[1], "CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[source]
        ).startswith(b"+OK")
        assert redis_command(
            source[1], "CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[target]
        ).startswith(b"+OK")
        try:
            # The key is not on the source: it answers ASK, the client asks the target.
            assert await client.execute("SET", key, "moved-in", key=key) == b"OK"
            assert client.asked >= 1
            assert redis_command(target[1], "DBSIZE") == b":1\r\n"
            # A pipeline is asked again as a whole, ASKING before each command.
            asked = client.asked
            pack = resp.pack_command
            replies = await client.pipeline(key, [pack(("GET", key)), pack(("STRLEN", key))])
            assert replies == [b"moved-in", 8]
            assert client.asked == asked + 1
        finally:
            redis_cluster.flushall()
            for address in (source, target):
                redis_command(address[1], "CLUSTER", "SETSLOT", str(slot), "NODE", ids[source])
    finally:
        await client.aclose()
