"""Usage against limits, as the InferenceCache status shows it: the buckets' state read
on an injected clock, by the same arithmetic as the sidecars' ``x-ratelimit-*`` headers."""

from __future__ import annotations

import pytest

from cachefleet_common.limits import (
    DAY_S,
    TenantLimits,
    decide,
    tats_of_fields,
    usage,
)
from cachefleet_operator.api import InferenceCacheStatus, TenantLimitsUsage, parse_spec
from cachefleet_operator.assignment import tenant_limits
from cachefleet_operator.cache_status import limits_usage

ALL_THREE = TenantLimits(requests_per_minute=120, tokens_per_minute=10_000, tokens_per_day=DAY_S)
#: Limits whose refill intervals are exact in binary (0.5 s, 2**-7 s, 1 s): the seconds
#: of :func:`decide` and the milliseconds of :func:`usage` then agree to the bit.
DYADIC = TenantLimits(requests_per_minute=120, tokens_per_minute=7680, tokens_per_day=DAY_S)
T0 = 1_000_000.0
#: Milliseconds on Redis's clock, as the script reads it (2026).
NOW_MS = 1_796_000_000_000


def ms(tats: list[float]) -> list[float]:
    return [t * 1000.0 for t in tats]


def charged(n: int, tokens: int, limits: TenantLimits = ALL_THREE) -> list[float]:
    """The buckets (milliseconds) after ``n`` admissions of ``tokens`` each at ``NOW_MS``,
    charged as the script does: ``tat = max(tat, now) + cost * period / limit``."""
    tats = [0.0, 0.0, 0.0]
    costs = (1, tokens, tokens)
    for _ in range(n):
        for i, limit in enumerate(limits.limits()):
            if limit:
                period_ms = (60_000, 60_000, 86_400_000)[i]
                tats[i] = max(tats[i], NOW_MS) + costs[i] * period_ms / limit
    return tats


def test_usage_is_what_the_headers_said_at_the_same_instant() -> None:
    tats = [0.0, 0.0, 0.0]
    for _ in range(7):
        decision, tats = decide(tats, T0, DYADIC, requests=1, tokens=300)
    states = usage(ms(tats), T0 * 1000.0, DYADIC)
    assert [(s.name, s.limit, s.remaining) for s in states] == [
        (b.name, b.limit, b.remaining) for b in decision.buckets
    ]
    assert [s.reset_s for s in states] == [b.reset_s for b in decision.buckets]
    assert [s.used for s in states] == [7, 2100, 2100]


def test_usage_on_redis_s_clock_loses_no_token() -> None:
    """Seconds since 1970 in a float cannot hold a 6 ms interval exactly (10,000 tokens a
    minute): the count is made in the script's whole milliseconds."""
    for tokens in (1, 2, 7, 300):
        tats = charged(1, tokens)
        assert [s.used for s in usage(tats, NOW_MS, ALL_THREE)] == [1, tokens, tokens]


def test_used_falls_as_the_buckets_refill() -> None:
    tats = charged(60, 100)  # 60 requests, 6000 tokens
    by_name = {s.name: s for s in usage(tats, NOW_MS + 15_000, ALL_THREE)}
    # 120/min refills 2 a second: 30 of the 60 are back after 15 s; tokens 10,000/min: 2500
    assert by_name["requests"].used == 30
    assert by_name["requests"].reset_s == pytest.approx(15.0)
    assert by_name["tokens"].used == 3500
    # a day of 86,400 tokens refills one a second
    assert by_name["tokens_per_day"].used == 6000 - 15
    later = {s.name: s for s in usage(tats, NOW_MS + 60_000, ALL_THREE)}
    assert (later["requests"].used, later["requests"].remaining) == (0, 120)
    assert later["requests"].reset_s == 0.0
    assert later["tokens_per_day"].used == 6000 - 60


def test_a_bucket_in_debt_shows_the_whole_limit_used_and_nothing_remaining() -> None:
    limits = TenantLimits(tokens_per_minute=1000)
    # an answer far larger than its estimate: the correction is charged as is
    tats = charged(1, 2500, limits)
    (state,) = usage(tats, NOW_MS + 30_000, limits)
    assert (state.name, state.limit, state.used, state.remaining) == ("tokens", 1000, 1000, 0)
    assert state.reset_s == pytest.approx(120.0)  # 2500 tokens at 1000 a minute, 30 s gone


def test_only_stated_limits_are_reported_and_a_missing_key_is_a_full_bucket() -> None:
    limits = TenantLimits(requests_per_minute=5)
    (state,) = usage(tats_of_fields([None, None, None]), NOW_MS, limits)
    assert (state.name, state.used, state.remaining, state.reset_s) == ("requests", 0, 5, 0.0)


def test_the_scripts_hash_is_read_as_it_is_written() -> None:
    assert tats_of_fields([b"1796000000123.500", "2000.000", None]) == [
        1_796_000_000_123.5,
        2000.0,
        0.0,
    ]
    assert tats_of_fields([b"garbage", None, None]) == [0.0, 0.0, 0.0]


def test_status_names_each_limit_by_its_spec_field() -> None:
    tats = charged(3, 50)  # 3 requests, 150 tokens; read half a second later
    doc = limits_usage(ALL_THREE, tats, NOW_MS + 500).wire()
    assert doc == {
        "requestsPerMinute": {"limit": 120, "used": 2, "remaining": 118, "resetSeconds": 1.0},
        "tokensPerMinute": {"limit": 10_000, "used": 67, "remaining": 9933, "resetSeconds": 0.4},
        "tokensPerDay": {"limit": 86_400, "used": 150, "remaining": 86_250, "resetSeconds": 149.5},
    }
    only = limits_usage(TenantLimits(tokens_per_day=1000), [0.0, 0.0, 0.0], NOW_MS).wire()
    assert list(only) == ["tokensPerDay"]
    # the status reads it back (and an older operator's status, without it, still reads)
    tenant = {
        "name": "a",
        "priorityClass": "Standard",
        "share": 0.5,
        "weight": 1.0,
        "l1Bytes": 1,
        "l2Bytes": 1,
        "reason": "r",
    }
    status = InferenceCacheStatus.model_validate({"tenants": [tenant | {"limits": doc}]})
    assert status.tenants is not None
    assert status.tenants[0].limits == TenantLimitsUsage.model_validate(doc)
    old = InferenceCacheStatus.model_validate({"tenants": [tenant]})
    assert old.tenants is not None
    assert old.tenants[0].limits is None


def test_only_tenants_with_limits_are_read() -> None:
    spec = parse_spec(
        {
            "selector": {"matchLabels": {"app": "x"}},
            "model": {"name": "m", "version": "v1"},
            "capacity": {"l1BytesPerPod": 2**30, "l2Bytes": 2**30},
            "redis": {"url": "redis://127.0.0.1:6379/0"},
            "prometheus": {"url": "http://127.0.0.1:9090"},
            "tenants": [
                {"name": "a", "limits": {"requestsPerMinute": 60, "tokensPerDay": 5000}},
                {"name": "b"},
                {"name": "c", "limits": {}},
            ],
        }
    )
    assert tenant_limits(spec) == {"a": TenantLimits(requests_per_minute=60, tokens_per_day=5000)}
