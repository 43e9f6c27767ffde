"""Per-tenant request and token limits: the pure arithmetic (GCRA), the estimate, the headers.

A tenant's limits (``tenants[].limits`` of the InferenceCache, or
``--tenant-limits``) are up to three buckets: ``requestsPerMinute``,
``tokensPerMinute`` (prompt + completion) and ``tokensPerDay``. Each is a
GCRA (generic cell rate algorithm, a token bucket kept as one number, the
theoretical arrival time ``tat``): a bucket of ``limit`` refills at
``limit / period`` and holds at most ``limit``, so an idle tenant may spend a
whole period's allowance at once (the burst) and then ``limit / period`` per
second. Over any window of ``w`` seconds at most ``limit * (1 + w / period)``
pass: in one minute at most the limit plus one minute's refill.

A request is admitted only if every bucket of its tenant has room
(all-or-nothing: nothing is charged on a refusal). A request costs 1 in the
request bucket and its token estimate (:func:`estimate_tokens`, clamped to the
bucket's limit, so one huge prompt is not refused forever) in the token
buckets; the answer's ``usage`` corrects the charge afterwards, as is, in
either direction (:func:`gcra` with ``force``).

The same arithmetic runs in Redis, fleet-wide
(:data:`cachefleet_common.contract.lua.RATE_LIMIT_LUA`), and in process when
Redis cannot be reached (each pod then enforces ``limit / live pods``,
:meth:`TenantLimits.share`). The operator reads the script's state and
reports where each bucket stands (:func:`usage`, the headers' arithmetic) in
the InferenceCache status. Times here are seconds, the script's
milliseconds; :func:`usage` reads the script's state in its milliseconds.
Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from cachefleet_common.contract.names import valid_name

MINUTE_S = 60.0
DAY_S = 86400.0
#: The buckets in the order the script takes them: (name, CRD field, period seconds).
BUCKETS: tuple[tuple[str, str, float], ...] = (
    ("requests", "requestsPerMinute", MINUTE_S),
    ("tokens", "tokensPerMinute", MINUTE_S),
    ("tokens_per_day", "tokensPerDay", DAY_S),
)
#: Characters per token of the admission estimate (the usual rule of thumb for English).
CHARS_PER_TOKEN = 4
#: Header names per bucket: OpenAI's for requests and tokens per minute; cachefleet's
#: own ``-tokens-day`` trio for the daily budget (OpenAI has none).
HEADER_SUFFIX = {"requests": "requests", "tokens": "tokens", "tokens_per_day": "tokens-day"}
#: The fields of the tenant's hash (:func:`~cachefleet_common.contract.names.rate_limit_key`)
#: that hold each bucket's ``tat`` in milliseconds, in :data:`BUCKETS` order.
STATE_FIELDS = ("r", "t", "d")


class LimitsError(ValueError):
    """A limits document that does not parse (names the tenant and field)."""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's limits; None: no such limit."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, *self._tokens()))

    def _tokens(self) -> tuple[int | None, int | None]:
        return self.tokens_per_minute, self.tokens_per_day

    def limits(self) -> tuple[int, int, int]:
        """The three limits in :data:`BUCKETS` order, 0 where there is none."""
        return (
            self.requests_per_minute or 0,
            self.tokens_per_minute or 0,
            self.tokens_per_day or 0,
        )

    def share(self, pods: int) -> TenantLimits:
        """This pod's local share when Redis cannot be reached: each limit / ``pods``
        (rounded down, at least 1)."""
        if pods <= 1:
            return self

        def part(v: int | None) -> int | None:
            return None if v is None else max(1, v // pods)

        return TenantLimits(
            part(self.requests_per_minute), part(self.tokens_per_minute), part(self.tokens_per_day)
        )

    def to_doc(self) -> dict[str, int]:
        """The camelCase document (CRD field names) of the limits that are set."""
        return {
            field: limit
            for (_, field, _), limit in zip(BUCKETS, self.limits(), strict=True)
            if limit > 0
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any], tenant: str = "?") -> TenantLimits:
        """Limits from a camelCase document; :class:`LimitsError` on anything else."""
        known = {field for _, field, _ in BUCKETS}
        values: dict[str, int | None] = {}
        for name, value in doc.items():
            if name not in known:
                raise LimitsError(
                    f"tenant {tenant!r}: unknown field {name!r} (expected {sorted(known)})"
                )
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise LimitsError(f"tenant {tenant!r}: {name} must be a positive integer")
            values[name] = value
        return cls(
            values.get("requestsPerMinute"),
            values.get("tokensPerMinute"),
            values.get("tokensPerDay"),
        )


def parse_limits(raw: bytes | str) -> dict[str, TenantLimits]:
    """``{"tenant-a": {"requestsPerMinute": 120, ...}}`` -> limits by tenant."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise LimitsError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise LimitsError('expected {"<tenant>": {"requestsPerMinute": N, ...}}')
    out: dict[str, TenantLimits] = {}
    for tenant, limits in doc.items():
        if not valid_name(tenant):
            raise LimitsError(f"invalid tenant name {tenant!r}: use 1-63 of [A-Za-z0-9._-]")
        if not isinstance(limits, dict):
            raise LimitsError(f"tenant {tenant!r}: expected an object of limits")
        parsed = TenantLimits.from_doc(limits, tenant)
        if parsed:
            out[str(tenant)] = parsed
    return out


def limits_flag(value: str) -> dict[str, TenantLimits]:
    """The ``--tenant-limits`` flag: the JSON itself when it starts with ``{``, else its file."""
    if value.lstrip().startswith("{"):
        return parse_limits(value)
    try:
        return parse_limits(Path(value).read_bytes())
    except OSError as exc:
        raise LimitsError(f"cannot read {value}: {exc.strerror}") from None


# --------------------------------------------------------------------------- estimate


def _text_chars(value: object) -> int:
    """Characters of prompt text in a message content / prompt / input value."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    if isinstance(value, dict):  # a content part: {"type": "text", "text": ...}
        return _text_chars(value.get("text"))
    return 0


def estimate_tokens(body: Mapping[str, Any] | None, raw_len: int = 0) -> int:
    """Tokens a request is charged at admission: its prompt's characters / 4 (messages'
    text, ``prompt`` or ``input``) plus ``max_completion_tokens`` / ``max_tokens`` when
    given; at least 1. Without a parsed body: the raw body's length / 4."""
    if body is None:
        return max(1, raw_len // CHARS_PER_TOKEN)
    chars = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        chars += sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
    chars += _text_chars(body.get("prompt")) + _text_chars(body.get("input"))
    completion = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(completion, bool) or not isinstance(completion, int) or completion < 0:
        completion = 0
    return max(1, math.ceil(chars / CHARS_PER_TOKEN) + completion)


# --------------------------------------------------------------------------- GCRA


@dataclass(frozen=True, slots=True)
class BucketState:
    """What one bucket says after a decision (the ``x-ratelimit-*`` headers)."""

    name: str
    limit: int
    remaining: int
    #: Seconds until the bucket is full again.
    reset_s: float
    #: Seconds until the refused cost would fit (0 when it fits now).
    retry_s: float

    @property
    def used(self) -> int:
        """What the bucket holds that has not refilled yet: ``limit - remaining``."""
        return self.limit - self.remaining


@dataclass(frozen=True, slots=True)
class Decision:
    """An admission decision over a tenant's buckets."""

    allowed: bool
    buckets: tuple[BucketState, ...]
    #: True when this pod decided alone (Redis could not be reached): its local share.
    local: bool = False

    @property
    def reason(self) -> str | None:
        """The first bucket that refused (None when allowed)."""
        if self.allowed:
            return None
        return next((b.name for b in self.buckets if b.retry_s > 0), self.buckets[0].name)

    @property
    def retry_after_s(self) -> float:
        return max((b.retry_s for b in self.buckets), default=0.0)


def gcra(
    tat: float, now: float, cost: float, limit: float, period: float, *, force: bool = False
) -> tuple[bool, float]:
    """One bucket: whether ``cost`` fits now, and the bucket's ``tat`` once charged.

    ``force``: charged as is, fitting or not (a correction; a negative cost
    refunds, never past a full bucket)."""
    interval = period / limit
    new_tat = max(max(tat, now) + cost * interval, now)
    return force or cost <= 0 or new_tat - period <= now, new_tat


def bucket_state(name: str, tat: float, now: float, limit: int, period: float) -> BucketState:
    """A bucket whose ``tat`` is ``tat``: its remaining allowance and time to full."""
    interval = period / limit
    after = max(tat, now)
    remaining = max(0, math.floor((now + period - after) / interval + 1e-9))
    return BucketState(name, limit, remaining, after - now, 0.0)


def usage(tats_ms: Sequence[float], now_ms: float, limits: TenantLimits) -> tuple[BucketState, ...]:
    """Where each of a tenant's buckets stands at ``now_ms``, charging nothing: the
    arithmetic of the ``x-ratelimit-*`` headers (:func:`bucket_state`) on the state the
    script keeps, in its units (milliseconds: ``tats_ms`` in :data:`BUCKETS` order, from
    :func:`tats_of_fields`; ``now_ms`` on Redis's clock), so that it is as exact as the
    script's own answer (whole milliseconds, where seconds since 1970 in a float would
    round a token away). Buckets without a limit are left out; ``reset_s`` in seconds."""
    out = []
    for i, ((name, _, period), limit) in enumerate(zip(BUCKETS, limits.limits(), strict=True)):
        if limit > 0:
            state = bucket_state(name, tats_ms[i], now_ms, limit, period * 1000.0)
            out.append(dataclasses.replace(state, reset_s=state.reset_s / 1000.0))
    return tuple(out)


def tats_of_fields(values: Sequence[bytes | str | None]) -> list[float]:
    """The ``tat`` of each bucket, milliseconds, from the script's hash (fields
    :data:`STATE_FIELDS`; a missing field or key: a full bucket, 0)."""
    out = []
    for value in values:
        try:
            out.append(0.0 if value is None else float(value))
        except ValueError:
            out.append(0.0)
    return out


def decide(
    tats: list[float],
    now: float,
    limits: TenantLimits,
    *,
    requests: int,
    tokens: int,
    force: bool = False,
) -> tuple[Decision, list[float]]:
    """Admit (every bucket fits: all are charged) or refuse (none is charged).

    Returns the decision and each bucket's ``tat`` afterwards (``tats`` in
    :data:`BUCKETS` order; unchanged on a refusal). The token cost is clamped to
    each bucket's limit unless ``force``. :data:`~cachefleet_common.contract.lua.RATE_LIMIT_LUA`
    computes the same in Redis."""
    plans: list[tuple[int, str, int, float, bool, float]] = []
    for i, ((name, _, period), limit) in enumerate(zip(BUCKETS, limits.limits(), strict=True)):
        if limit <= 0:
            continue
        cost = requests if i == 0 else tokens
        if not force:
            cost = min(cost, limit)
        fits, new_tat = gcra(tats[i], now, cost, limit, period, force=force)
        plans.append((i, name, limit, period, fits, new_tat))
    allowed = all(plan[4] for plan in plans)
    after = list(tats)
    states = []
    for i, name, limit, period, fits, new_tat in plans:
        if allowed:
            after[i] = new_tat
        state = bucket_state(name, after[i], now, limit, period)
        if not fits:  # when the cost would fit: once the bucket has refilled enough
            state = BucketState(name, limit, state.remaining, state.reset_s, new_tat - period - now)
        states.append(state)
    return Decision(allowed, tuple(states)), after


def decision_of_reply(reply: list[int], limits: TenantLimits) -> Decision:
    """The :class:`Decision` of the script's reply: ``allowed`` then, per bucket in
    :data:`BUCKETS` order, ``remaining, reset_ms, retry_ms`` (buckets without a limit
    are skipped in the reply's meaning)."""
    states = []
    for i, ((name, _, _), limit) in enumerate(zip(BUCKETS, limits.limits(), strict=True)):
        if limit <= 0:
            continue
        remaining, reset_ms, retry_ms = (int(v) for v in reply[1 + 3 * i : 4 + 3 * i])
        states.append(BucketState(name, limit, remaining, reset_ms / 1000.0, retry_ms / 1000.0))
    return Decision(bool(int(reply[0])), tuple(states))


# --------------------------------------------------------------------------- headers


def format_reset(seconds: float) -> str:
    """A duration the way OpenAI writes ``x-ratelimit-reset-*``: ``"250ms"``, ``"1s"``,
    ``"6m0s"``, ``"1h2m3s"`` (seconds rounded up to the millisecond)."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def header_lines(decision: Decision) -> list[tuple[str, str]]:
    """The ``x-ratelimit-limit-*`` / ``-remaining-*`` / ``-reset-*`` headers of a decision,
    and ``retry-after`` (whole seconds, rounded up) when refused."""
    out: list[tuple[str, str]] = []
    for b in decision.buckets:
        suffix = HEADER_SUFFIX[b.name]
        out += [
            (f"x-ratelimit-limit-{suffix}", str(b.limit)),
            (f"x-ratelimit-remaining-{suffix}", str(b.remaining)),
            (f"x-ratelimit-reset-{suffix}", format_reset(b.reset_s)),
        ]
    if not decision.allowed:
        out.append(("retry-after", str(max(1, math.ceil(decision.retry_after_s - 1e-6)))))
    return out


def refusal_message(decision: Decision) -> str:
    """The 429's message, in the words OpenAI uses."""
    name = decision.reason or "requests"
    bucket = next((b for b in decision.buckets if b.name == name), None)
    limit = "" if bucket is None else f" Limit {bucket.limit}"
    what = {
        "requests": "requests per min (RPM)",
        "tokens": "tokens per min (TPM)",
        "tokens_per_day": "tokens per day (TPD)",
    }[name]
    where = " (this pod's share: the fleet's limiter is unreachable)" if decision.local else ""
    return (
        f"Rate limit reached for {what}{where}:{limit}. "
        f"Please try again in {format_reset(decision.retry_after_s)}."
    )
