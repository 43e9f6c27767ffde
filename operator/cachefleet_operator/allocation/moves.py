"""The explanation of a reallocation: which tenants' shares moved, as an Event message."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from cachefleet_operator.allocation.model import EPS
from cachefleet_operator.allocation.result import Allocation, QuotaMove


def quota_moves(
    previous: Mapping[str, float] | None, allocation: Allocation, min_change: float = EPS
) -> list[QuotaMove]:
    """Tenants whose share changed by more than ``min_change``, biggest move first."""
    prev = dict(previous or {})
    moves: list[QuotaMove] = []
    for i, t in enumerate(allocation.tenants):
        before = prev.pop(t.name, None)
        if before is None or abs(t.share - before) > min_change:
            moves.append(QuotaMove(t.name, before, t.share, allocation.reason(i)))
    moves.extend(QuotaMove(name, share, None, "tenant removed") for name, share in prev.items())

    def size(m: QuotaMove) -> float:
        return abs((m.after or 0.0) - (m.before or 0.0))

    moves.sort(key=size, reverse=True)
    return moves


def _pct(share: float | None) -> str:
    return "none" if share is None else f"{share:.1%}"


def describe_moves(moves: Iterable[QuotaMove], limit: int = 10) -> str:
    """A one-line Event message: who gained, who lost, and why."""
    gained, lost = [], []
    for m in moves:
        text = f"{m.name} {_pct(m.before)}->{_pct(m.after)} ({m.reason})"
        if (m.after or 0.0) >= (m.before or 0.0):
            gained.append(text)
        else:
            lost.append(text)
    parts = []
    if gained:
        more = f" and {len(gained) - limit} more" if len(gained) > limit else ""
        parts.append("gained: " + "; ".join(gained[:limit]) + more)
    if lost:
        more = f" and {len(lost) - limit} more" if len(lost) > limit else ""
        parts.append("lost: " + "; ".join(lost[:limit]) + more)
    return " | ".join(parts) if parts else "no change"
