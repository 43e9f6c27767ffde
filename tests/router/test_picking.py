"""LeastLoadedPicker: the load-only picker (fallback for unreadable bodies)."""

from __future__ import annotations

from cachefleet_router.endpoints import Endpoint, EndpointMetrics, RouteRequest
from cachefleet_router.picking import LeastLoadedPicker


def test_spreads_by_outstanding_then_address_and_done_releases() -> None:
    picker = LeastLoadedPicker()
    pool = [Endpoint("10.0.0.2:8000"), Endpoint("10.0.0.1:8000")]
    req = RouteRequest()
    first = picker.pick(req, pool)
    second = picker.pick(req, pool)
    assert first is not None
    assert second is not None
    assert first.address == "10.0.0.1:8000"  # tie: lowest address
    assert second.address == "10.0.0.2:8000"  # the other one has a request in flight
    picker.done(first, req, ok=True)
    third = picker.pick(req, pool)
    assert third is not None
    assert third.address == "10.0.0.1:8000"
    assert picker.outstanding("10.0.0.1:8000") == 1


def test_reported_queue_breaks_ties_and_empty_pool_gives_none() -> None:
    picker = LeastLoadedPicker()
    busy = Endpoint("a:1", metrics=EndpointMetrics(waiting=5, running=3))
    idle = Endpoint("b:1", metrics=EndpointMetrics(waiting=0, running=1))
    decision = picker.pick(RouteRequest(), [busy, idle])
    assert decision is not None
    assert decision.address == "b:1"
    assert decision.reason == "least-loaded"
    assert picker.pick(RouteRequest(), []) is None
