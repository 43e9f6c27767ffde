"""Policy switches as Kubernetes Events: the pure parts (query, parsing, wording).

The kopf path is in tests/operator/test_inferencecache_kopf.py and the query
against a real Prometheus in tests/operator/test_metrics_source.py.
"""

from __future__ import annotations

from cachefleet_common.contract.promql import promql_policy_switches
from cachefleet_operator.cache_status import policy_switch_events
from cachefleet_operator.metrics_source import PolicySwitches, policy_switches_from
from cachefleet_operator.outcome import parse_rfc3339


def sample(tenant: str, old: str, new: str, value: str) -> dict[str, object]:
    return {
        "metric": {"tenant": tenant, "from_policy": old, "to_policy": new},
        "value": [1.0, value],
    }


def test_the_query_compares_each_series_with_its_value_a_span_ago() -> None:
    q = promql_policy_switches("ns/c", "90000ms")
    assert q.startswith("count by (tenant, from_policy, to_policy) ")
    assert 'cachefleet_policy_switches_total{cache="ns/c"} offset 90000ms' in q
    assert "increase(" not in q  # increase() loses changes between two spans


def test_parsing_keeps_counted_pairs_and_skips_malformed_samples() -> None:
    result = [
        sample("b", "sits", "lirs", "1"),
        sample("a", "lirs", "sits", "3"),
        sample("a", "lru", "sits", "0"),  # nobody switched: no Event
        {"metric": {"tenant": "a"}, "value": [1.0, "2"]},  # labels missing
        sample("c", "lirs", "sits", "NaN"),
        {"metric": {"tenant": "d", "from_policy": "x", "to_policy": "y"}},  # no value
    ]
    assert policy_switches_from(result) == [
        PolicySwitches("a", "lirs", "sits", 3),
        PolicySwitches("b", "sits", "lirs", 1),
    ]


def test_a_switch_to_sits_and_a_move_away_from_it_read_as_switch_and_rollback() -> None:
    events = policy_switch_events(
        [PolicySwitches("a", "lirs", "sits", 3), PolicySwitches("b", "sits", "lru", 1)]
    )
    assert [(e.type, e.reason) for e in events] == [
        ("Normal", "PolicySwitched"),
        ("Normal", "PolicyRolledBack"),
    ]
    assert events[0].message.startswith("tenant a: L1 policy switched lirs -> sits on 3 pods ")
    assert events[1].message.startswith("tenant b: L1 policy rolled back sits -> lru on 1 pod ")


def test_status_times_round_trip() -> None:
    assert parse_rfc3339("2026-11-30T18:00:00Z") == 1796061600.0
    assert parse_rfc3339(None) is None
    assert parse_rfc3339("yesterday") is None
