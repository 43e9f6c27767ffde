"""``kubectl cachefleet status`` shows each tenant's usage against its rate limits."""

from __future__ import annotations

import pytest

from cachefleet_operator.api import LimitUsage, TenantLimitsUsage
from cachefleet_operator.kubectl_plugin import views

from .test_kubectl_views import NOW, _cache, _status, _tenant_table


def _usage(**parts: tuple[int, int]) -> dict[str, object]:
    """``status.tenants[].limits`` with ``field=(used, limit)``."""
    return TenantLimitsUsage.model_validate(
        {
            name: LimitUsage(limit=limit, used=used, remaining=limit - used, reset_seconds=12.5)
            for name, (used, limit) in parts.items()
        }
    ).wire()


def test_a_limits_column_shows_used_against_each_limit() -> None:
    status = _status()
    status["tenants"][0]["limits"] = _usage(
        requestsPerMinute=(87, 120), tokensPerMinute=(4100, 10_000), tokensPerDay=(12_345, 10**6)
    )
    view = views.cache_view(_cache(status))
    rows = _tenant_table(views.render_status([view], NOW))
    assert rows[0][-1] == "LIMITS (USED/LIMIT)"
    assert rows[1][-1] == "req/min 87/120, tok/min 4.1k/10k, tok/day 12k/1M"
    assert rows[2][-1] == "-"  # a tenant without limits
    # wide: the column stays with the others (before the reason)
    wide = _tenant_table(views.render_status([view], NOW, wide=True))
    assert wide[0][-2:] == ["LIMITS (USED/LIMIT)", "REASON"]
    assert wide[1][-2] == "req/min 87/120, tok/min 4.1k/10k, tok/day 12k/1M"


def test_only_the_limits_a_tenant_states_are_shown() -> None:
    status = _status()
    status["tenants"][1]["limits"] = _usage(tokensPerDay=(250_000, 2_000_000))
    rows = _tenant_table(views.render_status([views.cache_view(_cache(status))], NOW))
    assert rows[2][-1] == "tok/day 250k/2M"


def test_no_limits_no_column() -> None:
    text = views.render_status([views.cache_view(_cache(_status()))], NOW)
    assert "LIMITS" not in text


def test_json_carries_the_usage_and_leaves_it_out_where_there_is_none() -> None:
    status = _status()
    status["tenants"][0]["limits"] = _usage(requestsPerMinute=(6, 6))
    item = views.status_document([views.cache_view(_cache(status))])["items"][0]
    assert item["tenants"][0]["limits"] == [
        {
            "limit_name": "requestsPerMinute",
            "limit": 6,
            "used": 6,
            "remaining": 0,
            "reset_seconds": 12.5,
        }
    ]
    assert "limits" not in item["tenants"][1]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0"),
        (87, "87"),
        (999, "999"),
        (1000, "1k"),
        (4100, "4.1k"),
        (9960, "10k"),
        (12_345, "12k"),
        (999_499, "999k"),
        (999_999, "1M"),
        (1_000_000, "1M"),
        (1_500_000, "1.5M"),
        (2_000_000_000, "2G"),
        (None, "-"),
    ],
)
def test_human_count(n: int | None, text: str) -> None:
    assert views.human_count(n) == text
