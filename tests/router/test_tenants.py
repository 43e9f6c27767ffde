"""Tenants and priority classes from the operator's quota table, with a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from redis.asyncio import Redis

from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_common.contract.names import quotas_key
from cachefleet_common.contract.ops import publish_quotas
from cachefleet_router.server import RouterConfig, RouterServer
from cachefleet_router.tenants import TenantClasses, TenantSync

from .conftest import Gateway, body_message, headers_message
from .test_extproc import RecordingPicker

CACHE = "ml/chat"
WAIT_S = 15.0


def assignment(generation: int, classes: dict[str, str | None]) -> QuotaAssignment:
    return QuotaAssignment(
        generation=generation,
        tenants={
            name: TenantQuota(l1_bytes=1 << 20, l2_bytes=1 << 20, priority_class=cls)  # type: ignore[arg-type]
            for name, cls in classes.items()
        },
    )


async def until(predicate: Callable[[], Any], message: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not predicate():
        if loop.time() > deadline:
            pytest.fail(f"timed out: {message}")
        await asyncio.sleep(0.02)


def test_without_a_table_every_tenant_is_standard() -> None:
    table = TenantClasses()
    assert table.class_of("anyone") is None
    assert table.apply(assignment(2, {"gold": "Guaranteed"}))
    assert not table.apply(assignment(1, {"gold": "BestEffort"}))  # older: ignored
    assert table.class_of("gold") == "Guaranteed"
    assert table.class_of("new") is None


def test_unlisted_tenants_get_the_class_of_the_tenant_defaults() -> None:
    table = TenantClasses()
    with_defaults = assignment(1, {"gold": "Guaranteed"}).model_copy(
        update={"default_tenant": TenantQuota(l1_bytes=0, l2_bytes=0, priority_class="BestEffort")}
    )
    assert table.apply(with_defaults)
    assert table.class_of("customer-4711") == "BestEffort"
    assert table.class_of("gold") == "Guaranteed"
    assert table.apply(assignment(2, {"gold": "Guaranteed"}))  # defaults removed
    assert table.class_of("customer-4711") is None


@pytest.mark.redis
async def test_classes_follow_the_operators_notices(redis_url: str) -> None:
    operator = Redis.from_url(redis_url)
    table = TenantClasses()
    sync = TenantSync(redis_url, CACHE, table, poll_s=60.0)  # only a notice can be in time
    task = asyncio.ensure_future(sync.run())
    try:
        await publish_quotas(
            operator, CACHE, assignment(1, {"gold": "Guaranteed", "bulk": "BestEffort"})
        )
        await until(lambda: table.generation == 1, "the first assignment")
        assert table.class_of("gold") == "Guaranteed"
        assert table.class_of("bulk") == "BestEffort"

        await until(lambda: sync.subscribed.is_set(), "the control subscription")
        await publish_quotas(operator, CACHE, assignment(2, {"gold": None}))
        await until(lambda: table.generation == 2, "the notice of generation 2")
        assert table.class_of("gold") is None
        assert table.class_of("bulk") is None
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await operator.aclose()


@pytest.mark.redis
async def test_a_lost_notice_is_caught_by_the_poll(redis_url: str) -> None:
    operator = Redis.from_url(redis_url)
    table = TenantClasses()
    sync = TenantSync(redis_url, CACHE, table, poll_s=0.2)
    task = asyncio.ensure_future(sync.run())
    try:
        await until(lambda: sync.subscribed.is_set() and sync.reads >= 1, "the first read")
        assert table.generation == -1  # nothing stored yet: everyone Standard
        # A write nobody announced (a lost notice) is found by the bounded poll.
        later = assignment(3, {"bulk": "BestEffort"})
        await operator.hset(
            quotas_key(CACHE),
            mapping={"generation": "3", "assignment": later.model_dump_json()},
        )
        await until(lambda: table.generation == 3, "the poll to find generation 3")
        assert table.class_of("bulk") == "BestEffort"

        # An unreadable table is not applied; the last good one stays.
        await operator.hset(
            quotas_key(CACHE), mapping={"generation": "4", "assignment": "{not json"}
        )
        await until(lambda: sync.errors >= 1, "the unreadable table to be seen")
        assert table.generation == 3
        assert table.class_of("bulk") == "BestEffort"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await operator.aclose()


@pytest.mark.redis
async def test_the_router_hands_the_tenant_class_to_the_picker(redis_url: str) -> None:
    operator = Redis.from_url(redis_url)
    await publish_quotas(operator, CACHE, assignment(1, {"gold": "Guaranteed"}))
    picker = RecordingPicker()
    router = RouterServer(
        RouterConfig(
            grpc_listen=("127.0.0.1", 0),
            metrics_listen=None,
            endpoints=("127.0.0.1:1",),
            scrape_interval_s=0,
            redis_url=redis_url,
            cache=CACHE,
        ),
        picker=picker,
    )
    await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}")
    try:
        await until(lambda: router.tenants.generation == 1, "the router to read the table")
        gw = Gateway(channel)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        for tenant in ("gold", "walk-in"):
            await gw.exchange(
                [
                    headers_message({"x-tenant-id": tenant}),
                    body_message(body.encode(), end_of_stream=True),
                ],
                2,
            )
        assert [(r.tenant, r.priority_class) for r in picker.requests] == [
            ("gold", "Guaranteed"),
            ("walk-in", None),
        ]
    finally:
        await channel.close()
        await router.stop(0)
        await operator.aclose()
