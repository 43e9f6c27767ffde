"""The floor of ``cachefleet bench invalidation``: the minimal subscriber is acknowledged
like a sidecar, every invalidation completes, and it leaves the membership when stopped."""

from __future__ import annotations

import pytest

from cachefleet_bench import invalidation
from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.ops import live_members, read_acks


@pytest.mark.bench
@pytest.mark.redis
async def test_minimal_subscribers_acknowledge_every_invalidation_and_leave(
    redis_url: str,
) -> None:
    times, incomplete = await invalidation.propagation(redis_url, 2, 5, 0, minimal=True)
    assert incomplete == 0
    assert len(times) == 5
    assert all(t > 0 for t in times)
    client = redis_from_url(redis_url)
    try:
        # gone at once (not after a heartbeat's expiry): a later phase must not wait for them
        assert await live_members(client, invalidation.CACHE) == []
        assert await read_acks(client, invalidation.CACHE) == {}
    finally:
        await client.aclose()
