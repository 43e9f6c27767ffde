"""The rate limits' pure parts: GCRA arithmetic on an injected clock, the token estimate,
the headers, the limits documents, and the operator carrying tenants[].limits."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachefleet_common.contract.messages import QuotaAssignment, RateLimits, TenantQuota
from cachefleet_common.limits import (
    DAY_S,
    Decision,
    LimitsError,
    TenantLimits,
    decide,
    decision_of_reply,
    estimate_tokens,
    format_reset,
    gcra,
    header_lines,
    limits_flag,
    parse_limits,
)
from cachefleet_operator.allocation import allocate
from cachefleet_operator.api import SpecError, parse_spec
from cachefleet_operator.assignment import assignment_digest, build_assignment, demands_from_spec
from cachefleet_sidecar.config import parse_args
from cachefleet_sidecar.tasks import Background
from cachefleet_sidecar.tenancy.limits_redis import RateLimiter

from .crd_schema import spec_errors

RPM_120 = TenantLimits(requests_per_minute=120)


def run(limits: TenantLimits, times: list[float], *, tokens: int = 0) -> list[Decision]:
    """Decisions of one request at each time, on one bucket state."""
    tats = [0.0, 0.0, 0.0]
    out = []
    for now in times:
        decision, tats = decide(tats, now, limits, requests=1, tokens=tokens)
        out.append(decision)
    return out


def test_an_idle_tenant_spends_its_whole_minute_at_once_then_limit_per_period() -> None:
    burst = run(RPM_120, [1000.0] * 200)
    assert sum(d.allowed for d in burst) == 120  # the bucket holds one minute's allowance
    assert [d.allowed for d in burst[:120]] == [True] * 120
    refused = burst[120]
    assert refused.reason == "requests"
    assert refused.retry_after_s == pytest.approx(0.5)  # one request refills in 60/120 s
    assert refused.buckets[0].remaining == 0


def test_passes_in_any_window_are_at_most_the_limit_plus_the_refill() -> None:
    # 600 requests over 30 s, evenly: 120 (burst) + 30 s * 2/s (refill) pass, at most
    times = [1000.0 + i * 0.05 for i in range(600)]
    passed = sum(d.allowed for d in run(RPM_120, times))
    assert passed <= 120 + 30 * 2 + 1
    assert passed >= 120 + 30 * 2 - 1
    # a steady rate under the limit is never refused
    slow = [1000.0 + i * 0.6 for i in range(300)]
    assert all(d.allowed for d in run(RPM_120, slow))


def test_a_refusal_charges_nothing_in_any_bucket() -> None:
    limits = TenantLimits(requests_per_minute=10, tokens_per_minute=100)
    tats = [0.0, 0.0, 0.0]
    decision, tats = decide(tats, 50.0, limits, requests=1, tokens=90)
    assert decision.allowed
    before = list(tats)
    refused, after = decide(tats, 50.0, limits, requests=1, tokens=20)
    assert not refused.allowed
    assert refused.reason == "tokens"
    assert after == before  # the request bucket had room, but was not charged either
    requests, tokens = refused.buckets
    assert (requests.name, requests.remaining) == ("requests", 9)
    assert (tokens.name, tokens.remaining) == ("tokens", 10)
    assert tokens.retry_s == pytest.approx(6.0)  # 10 more tokens refill in 10 * 0.6 s
    assert refused.retry_after_s == pytest.approx(6.0)


def test_token_cost_above_the_limit_is_clamped_and_corrections_apply_as_is() -> None:
    limits = TenantLimits(tokens_per_minute=1000)
    tats = [0.0, 0.0, 0.0]
    # a prompt estimated past the whole minute still passes on a full bucket ...
    decision, tats = decide(tats, 0.0, limits, requests=1, tokens=5000)
    assert decision.allowed
    assert decision.buckets[0].remaining == 0
    # ... and its real usage, charged by force, leaves the bucket in debt for longer
    decision, tats = decide(tats, 0.0, limits, requests=0, tokens=1000, force=True)
    assert decision.allowed
    assert decision.buckets[0].reset_s == pytest.approx(120.0)
    refused, _ = decide(tats, 60.0, limits, requests=1, tokens=1)
    assert not refused.allowed
    # a refund never makes the bucket fuller than full
    decision, tats = decide(tats, 60.0, limits, requests=0, tokens=-(10**6), force=True)
    assert decision.buckets[0].remaining == 1000
    assert decision.buckets[0].reset_s == 0.0


def test_tokens_per_day_is_its_own_bucket() -> None:
    limits = TenantLimits(tokens_per_minute=10_000, tokens_per_day=15_000)
    tats = [0.0, 0.0, 0.0]
    ok, tats = decide(tats, 0.0, limits, requests=1, tokens=9_000)
    assert ok.allowed
    ok, tats = decide(tats, 120.0, limits, requests=1, tokens=6_000)  # the minute refilled
    assert ok.allowed
    refused, _ = decide(tats, 240.0, limits, requests=1, tokens=1_000)
    assert refused.reason == "tokens_per_day"
    day = next(b for b in refused.buckets if b.name == "tokens_per_day")
    assert day.retry_s == pytest.approx(1_000 * DAY_S / 15_000 - 240.0, rel=1e-6)


def test_gcra_forced_and_zero_costs_always_fit() -> None:
    assert gcra(100.0, 0.0, 5, 10, 60.0, force=True) == (True, 130.0)
    assert gcra(1000.0, 0.0, 0, 10, 60.0)[0]
    assert not gcra(60.0, 0.0, 1, 10, 60.0)[0]


def test_local_share_divides_every_limit() -> None:
    limits = TenantLimits(120, 10_000, 1_000_000)
    assert limits.share(2) == TenantLimits(60, 5_000, 500_000)
    assert limits.share(1) is limits
    assert TenantLimits(requests_per_minute=1).share(4).requests_per_minute == 1
    assert sum(d.allowed for d in run(limits.share(3), [0.0] * 100)) == 40


def test_estimate_counts_prompt_text_and_max_tokens() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "x" * 40},
            {"role": "user", "content": [{"type": "text", "text": "y" * 41}]},
        ],
        "max_tokens": 100,
    }
    assert estimate_tokens(body) == 21 + 100
    assert estimate_tokens({"prompt": ["a" * 8, "b" * 8], "max_completion_tokens": 3}) == 7
    assert estimate_tokens({"input": "z" * 400}) == 100
    assert estimate_tokens({"messages": []}) == 1
    assert estimate_tokens(None, raw_len=4000) == 1000
    assert estimate_tokens({"prompt": "abcd", "max_tokens": True}) == 1


def test_reset_durations_read_like_openai() -> None:
    assert format_reset(0.0) == "0ms"
    assert format_reset(0.25) == "250ms"
    assert format_reset(1.0) == "1s"
    assert format_reset(12.5) == "12.5s"
    assert format_reset(360.0) == "6m0s"
    assert format_reset(3723.0) == "1h2m3s"


def test_headers_name_each_bucket_and_retry_after_only_on_refusal() -> None:
    limits = TenantLimits(requests_per_minute=2, tokens_per_minute=100, tokens_per_day=1000)
    tats = [0.0, 0.0, 0.0]
    ok, tats = decide(tats, 0.0, limits, requests=1, tokens=10)
    headers = dict(header_lines(ok))
    assert headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "90",
        "x-ratelimit-reset-tokens": "6s",
        "x-ratelimit-limit-tokens-day": "1000",
        "x-ratelimit-remaining-tokens-day": "990",
        "x-ratelimit-reset-tokens-day": "14m24s",
    }
    _, tats = decide(tats, 0.0, limits, requests=1, tokens=10)
    refused, _ = decide(tats, 0.0, limits, requests=1, tokens=10)
    headers = dict(header_lines(refused))
    assert headers["retry-after"] == "30"
    assert headers["x-ratelimit-remaining-requests"] == "0"


def test_script_reply_reads_back_into_a_decision() -> None:
    limits = TenantLimits(requests_per_minute=120, tokens_per_day=5)
    reply = [0, 0, 60_000, 500, 0, 0, 0, 3, 1000, 0]
    decision = decision_of_reply(reply, limits)
    assert not decision.allowed
    assert [b.name for b in decision.buckets] == ["requests", "tokens_per_day"]
    assert decision.reason == "requests"
    assert decision.retry_after_s == pytest.approx(0.5)
    assert decision.buckets[1].remaining == 3


def test_limits_documents_parse_and_refuse_what_is_wrong(tmp_path: Path) -> None:
    doc = {"tenant-a": {"requestsPerMinute": 120, "tokensPerMinute": 10000, "tokensPerDay": 10**6}}
    assert parse_limits(json.dumps(doc)) == {"tenant-a": TenantLimits(120, 10000, 1_000_000)}
    path = tmp_path / "limits.json"
    path.write_text(json.dumps(doc))
    assert limits_flag(str(path)) == limits_flag(json.dumps(doc))
    assert parse_limits('{"b": {}}') == {}  # no limit at all: not limited
    for bad in (
        '{"a": {"requestsPerMinute": 0}}',
        '{"a": {"requestsPerMinute": 1.5}}',
        '{"a": {"requestsPerMinute": true}}',
        '{"a": {"rpm": 10}}',
        '{"a": 5}',
        '{"a{x}": {"requestsPerMinute": 1}}',
        "[1]",
        "not json",
    ):
        with pytest.raises(LimitsError):
            parse_limits(bad)
    with pytest.raises(LimitsError, match="cannot read"):
        limits_flag(str(tmp_path / "missing.json"))


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_args(["--tenant-limits", '{"a": {"requestsPerMinute": 60}}'])
    assert config.tenancy.tenant_limits == {"a": TenantLimits(requests_per_minute=60)}
    assert config.tenancy.limits_count_hits is False
    monkeypatch.setenv("CACHEFLEET_TENANT_LIMITS", '{"b": {"tokensPerDay": 7}}')
    monkeypatch.setenv("CACHEFLEET_LIMITS_COUNT_HITS", "true")
    config = parse_args([])
    assert config.tenancy.tenant_limits == {"b": TenantLimits(tokens_per_day=7)}
    assert config.tenancy.limits_count_hits is True
    with pytest.raises(SystemExit):
        parse_args(["--tenant-limits", '{"a": {"requestsPerMinute": -1}}'])


def test_quota_limits_are_optional_both_ways() -> None:
    # an old operator's table (no limits) reads; an old sidecar ignores the new field
    old = QuotaAssignment.model_validate_json(
        '{"generation": 1, "tenants": {"a": {"l1_bytes": 1, "l2_bytes": 2}}}'
    )
    assert old.tenants["a"].limits is None
    new = QuotaAssignment(
        generation=2,
        tenants={"a": TenantQuota(l1_bytes=1, l2_bytes=2, limits=RateLimits(tokens_per_day=9))},
    )
    again = QuotaAssignment.model_validate_json(new.model_dump_json())
    limits = again.tenants["a"].limits
    assert limits is not None
    assert limits.tokens_per_day == 9


# --------------------------------------------------------------------------- the operator


def _spec() -> dict[str, Any]:
    example = Path(__file__).parents[2] / "examples" / "inferencecache.yaml"
    return copy.deepcopy(yaml.safe_load(example.read_text())["spec"])


def _table(raw: dict[str, Any]) -> QuotaAssignment:
    parsed = parse_spec(raw)
    allocation = allocate(demands_from_spec(parsed), {}, None, 1 << 30, 1 << 34)
    return build_assignment(parsed, allocation)


def test_crd_limits_reach_the_quota_table_and_leave_others_digest_alone() -> None:
    raw = _spec()
    before = assignment_digest(_table(raw))
    first, second = raw["tenants"][0]["name"], raw["tenants"][1]["name"]
    raw["tenants"][0]["limits"] = {"requestsPerMinute": 120, "tokensPerMinute": 10000}
    assert spec_errors(raw, sep="/") == []
    assignment = _table(raw)
    limits = assignment.tenants[first].limits
    assert limits == RateLimits(requests_per_minute=120, tokens_per_minute=10000)
    assert assignment.tenants[second].limits is None
    assert assignment_digest(assignment) != before
    raw["tenants"][0]["limits"] = {}  # an empty block: no limits, the digest of before
    assert _table(raw).tenants[first].limits is None
    assert assignment_digest(_table(raw)) == before


@pytest.mark.parametrize(
    "limits",
    [{"requestsPerMinute": 0}, {"tokensPerDay": -1}, {"tokensPerMinute": "many"}, {"rpm": 5}],
)
def test_bad_crd_limits_are_refused_by_the_operator_and_the_schema(limits: dict[str, Any]) -> None:
    raw = _spec()
    raw["tenants"][0]["limits"] = limits
    with pytest.raises(SpecError, match="limits"):
        parse_spec(raw)
    assert spec_errors(raw, sep="/"), "the API server's schema lets it through"


# --------------------------------------------------------------------------- the limiter alone


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chat(content: str, **fields: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **fields}).encode()


def answer(prompt: int, completion: int) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    return json.dumps({"choices": [], "usage": usage}).encode()


def stream_answer(prompt: int, completion: int) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    return (
        b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
        + b"data: "
        + json.dumps({"choices": [], "usage": usage}).encode()
        + b"\n\ndata: [DONE]\n\n"
    )


def limiter(limits: dict[str, TenantLimits], clock: Clock) -> RateLimiter:
    return RateLimiter("ns/c", limits=limits, client=None, background=Background(), clock=clock)


async def test_without_redis_the_pod_enforces_the_whole_limit_and_says_so() -> None:
    clock = Clock()
    refused: list[tuple[str, str]] = []
    rates = limiter({"a": TenantLimits(requests_per_minute=3)}, clock)
    rates.on_refused = lambda tenant, reason: refused.append((tenant, reason))
    tickets = [await rates.admit("a", chat("hi")) for _ in range(4)]
    assert [t.refusal is None for t in tickets] == [True, True, True, False]
    assert refused == [("a", "requests")]
    refusal = tickets[3].refusal
    assert refusal is not None
    assert refusal.startswith(b"HTTP/1.1 429 ")
    assert b"retry-after: 20\r\n" in refusal
    assert b'"code":"rate_limit_exceeded"' in refusal
    assert b"\r\nx-ratelimit-remaining-requests: 2" in tickets[0].x_cache_tail
    assert not rates.limited("b")
    status = rates.status()
    assert (status["mode"], status["local_share"]) == ("local", "1/1")
    assert status["tenants"]["a"]["refused"] == {"requests": 1}
    assert status["tenants"]["a"]["usage"]["requests"]["remaining"] == 0
    clock.now += 20.0  # one more refilled
    assert (await rates.admit("a", chat("hi"))).refusal is None


async def test_the_usage_corrects_the_estimate_both_ways() -> None:
    clock = Clock()
    rates = limiter({"a": TenantLimits(tokens_per_minute=1000)}, clock)

    async def left() -> int:  # tokens left, read by a 1-token probe
        probe = await rates.admit("a", chat(""))
        return probe.decision.buckets[0].remaining + 1

    # estimated 100 (400 characters); the answer says 900 were used: 100 left
    ticket = await rates.admit("a", chat("x" * 400))
    assert ticket.tokens == 100
    assert ticket.decision.buckets[0].remaining == 900
    rates.settle(ticket, 200, answer(100, 800))
    rates.settle(ticket, 200, answer(100, 800))  # settled once only
    assert (await rates.admit("a", chat("x" * 404))).refusal is not None  # 101 > 100
    assert (await rates.admit("a", chat("x" * 400))).refusal is None  # 100 fit
    # a stream's last usage event counts the same way: estimated 1000, used 30
    clock.now += 60.0
    ticket = await rates.admit("a", chat("y" * 40, max_tokens=990))
    assert ticket.tokens == 1000
    rates.settle(ticket, 200, stream_answer(10, 20))
    assert await left() == 970
    # an error answer, or no answer, gives the tokens back; an unknown usage keeps them
    cases = ((500, b'{"error": {}}', 1000), (None, None, 1000), (200, b"{}", 500))
    for status, body, expected in cases:
        clock.now += 120.0
        ticket = await rates.admit("a", chat("w" * 2000))
        assert ticket.tokens == 500
        rates.settle(ticket, status, body)
        assert await left() == expected


async def test_operator_limits_replace_the_flags_for_the_tenants_it_names() -> None:
    rates = limiter(
        {"a": TenantLimits(requests_per_minute=1), "b": TenantLimits(tokens_per_day=5)}, Clock()
    )
    assignment = QuotaAssignment(
        generation=1,
        tenants={
            "a": TenantQuota(l1_bytes=1, l2_bytes=1, limits=RateLimits(requests_per_minute=50)),
            "c": TenantQuota(l1_bytes=1, l2_bytes=1),
        },
    )
    assert (await rates.admit("b", chat("hi"))).refusal is None
    rates.apply(assignment)
    assert rates.table == {
        "a": TenantLimits(requests_per_minute=50),
        "b": TenantLimits(None, None, 5),
    }
    rates.apply(
        assignment.model_copy(update={"tenants": {"b": TenantQuota(l1_bytes=1, l2_bytes=1)}})
    )
    assert rates.table == {"a": TenantLimits(requests_per_minute=1)}  # b named without limits
    assert "b" not in rates.status()["tenants"]
    assert rates.last.keys() <= rates.table.keys()


class BrokenClient:
    """A Redis client whose every call fails the way no RespError does."""

    calls = 0

    async def run_script(self, *args: Any, **kwargs: Any) -> Any:
        BrokenClient.calls += 1
        raise RuntimeError("limiter bug")


async def test_any_limiter_fault_falls_back_to_the_local_share() -> None:
    rates = RateLimiter(
        "ns/c",
        limits={"a": TenantLimits(requests_per_minute=4)},
        client=BrokenClient(),  # type: ignore[arg-type]
        background=Background(),
        clock=Clock(),
    )
    rates.live_pods = 2
    tickets = [await rates.admit("a", chat("hi")) for _ in range(3)]
    assert [t.refusal is None for t in tickets] == [True, True, False]  # 4 / 2 pods
    assert BrokenClient.calls == 1  # then this pod decides alone for REDIS_RETRY_S
    status = rates.status()
    assert (status["mode"], status["local_share"]) == ("local", "1/2")
    assert "RuntimeError" in status["redis_error"]
    refusal = tickets[2].refusal
    assert refusal is not None
    assert b"this pod's share" in refusal
