"""Curves the allocator reasons with: hit ratio by cache size, latency distributions (pure).

* :class:`HitCurve`: a tenant's predicted hit ratio as a function of the
  bytes it is given, from the reuse-distance histogram the sidecars export
  (:mod:`cachefleet_sidecar.mrc`), summed over pods. ``at(bytes)``
  interpolates; ``hull(lo, hi)`` is the concave majorant on a grid, the form
  a greedy allocator can use without being fooled by cliffs (a working set
  that pays off only once it fits whole: Talus, Beckmann & Sanchez HPCA'15).
* :class:`LatencyDist`: a latency histogram (Prometheus buckets); quantiles
  by linear interpolation as ``histogram_quantile`` does, and the mean.
* :func:`predicted_p95`: the p95 of the mix of hits and misses at a given
  hit ratio (hits are assumed faster than every miss).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def _cumulative(buckets: Iterable[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Sorted (bound, cumulative count) pairs, made monotone (rate() noise can dent them)."""
    out: list[tuple[float, float]] = []
    best = 0.0
    for bound, count in sorted((float(b), float(c)) for b, c in buckets):
        if not math.isfinite(count):
            continue
        best = max(best, count)
        out.append((bound, best))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class HitCurve:
    """Hit ratio by cache bytes: ``points`` are (bytes, hit ratio), both ascending, from (0, 0)."""

    points: tuple[tuple[float, float], ...]
    #: Fraction of requests that are first accesses (no size ever makes them hits).
    cold_ratio: float
    #: Estimated requests behind the curve (for confidence, not for the shape).
    requests: float
    #: Bytes of the distinct data the tenant showed in the curve's window (None: unknown).
    footprint_bytes: float | None = None
    #: The points' sizes and hit ratios apart (derived, for bisection).
    xs: tuple[float, ...] = field(init=False, repr=False, compare=False)
    ys: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "xs", tuple(x for x, _ in self.points))
        object.__setattr__(self, "ys", tuple(y for _, y in self.points))

    @classmethod
    def from_histogram(
        cls,
        buckets: Iterable[tuple[float, float]],
        total_requests: float | None = None,
        footprint_bytes: float | None = None,
    ) -> HitCurve | None:
        """From cumulative (le, count) buckets including ``+Inf``; None if empty.

        ``total_requests``, when known (the sidecars count every lookup), corrects
        the sampling error of SHARDS the way SHARDS-adj does: the difference
        between the true and the estimated total is credited to the smallest
        bucket (hot keys that happened to be sampled too rarely or too often),
        when the sample saw any reuse at all.
        """
        cum = _cumulative(buckets)
        if not cum or not math.isinf(cum[-1][0]):
            return None
        estimated = cum[-1][1]
        if estimated <= 0.0:
            return None
        total = estimated
        adjust = 0.0
        reused = cum[-2][1] > 0.0 if len(cum) > 1 else False
        # Only a sample that saw reuse is corrected: a tenant whose sampled keys were all
        # first accesses (a scan) shows no reuse, and the difference is not evidence of any.
        if (
            reused
            and total_requests is not None
            and total_requests > 0.0
            and math.isfinite(total_requests)
        ):
            total = total_requests
            adjust = total_requests - estimated
        points: list[tuple[float, float]] = [(0.0, 0.0)]
        for bound, count in cum[:-1]:
            hits = max(0.0, count + adjust)
            points.append((bound, min(1.0, hits / total)))
        cold = max(0.0, 1.0 - (points[-1][1] if len(points) > 1 else 0.0))
        return cls(tuple(points), cold, total, footprint_bytes)

    @classmethod
    def from_hits(
        cls,
        hits_by_size: Iterable[tuple[float, float]],
        requests: float,
        *,
        cold_ratio: float | None = None,
        footprint_bytes: float | None = None,
    ) -> HitCurve | None:
        """From (size, estimated hits) of a mini-simulation of the tenant's own policy.

        Made monotone (a bigger miniature cache can lose a few hits to sampling
        noise); ``cold_ratio`` comes from the reuse histogram when known.
        """
        if not requests > 0.0 or not math.isfinite(requests):
            return None
        points: list[tuple[float, float]] = [(0.0, 0.0)]
        for size, hits in sorted((float(s), float(h)) for s, h in hits_by_size):
            if size <= points[-1][0] or not math.isfinite(hits):
                continue
            points.append((size, min(1.0, max(points[-1][1], hits / requests))))
        if len(points) < 2:
            return None
        cold = 1.0 - points[-1][1] if cold_ratio is None else cold_ratio
        return cls(tuple(points), cold, requests, footprint_bytes)

    def at(self, size: float) -> float:
        """Predicted hit ratio with ``size`` bytes (linear inside a bucket)."""
        xs, ys = self.xs, self.ys
        if size <= 0.0 or len(xs) < 2:
            return 0.0
        hi = bisect_right(xs, size)
        if hi >= len(xs):
            return ys[-1]
        x0, y0 = xs[hi - 1], ys[hi - 1]
        return y0 + (ys[hi] - y0) * (size - x0) / (xs[hi] - x0)

    @property
    def max_hit_ratio(self) -> float:
        return self.points[-1][1] if self.points else 0.0

    def hull(self, grid: Sequence[float]) -> list[tuple[float, float]]:
        """Concave majorant of (x, at(x)) over ascending ``grid`` (upper hull)."""
        hull: list[tuple[float, float]] = []
        for x in grid:
            p = (x, self.at(x))
            while len(hull) >= 2:
                (x1, y1), (x2, y2) = hull[-2], hull[-1]
                # drop the middle point if it lies on or below the chord
                if (y2 - y1) * (p[0] - x1) <= (p[1] - y1) * (x2 - x1):
                    hull.pop()
                else:
                    break
            hull.append(p)
        return hull


@dataclass(frozen=True, slots=True)
class LatencyDist:
    """A latency histogram: cumulative (le seconds, count) with ``+Inf`` last."""

    buckets: tuple[tuple[float, float], ...]
    sum_s: float | None = None
    _mean: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_mean", self._compute_mean())

    @classmethod
    def from_buckets(
        cls, buckets: Iterable[tuple[float, float]], sum_s: float | None = None
    ) -> LatencyDist | None:
        cum = _cumulative(buckets)
        if not cum or cum[-1][1] <= 0.0:
            return None
        return cls(cum, sum_s)

    @property
    def count(self) -> float:
        return self.buckets[-1][1]

    def quantile(self, q: float) -> float:
        """As PromQL's ``histogram_quantile``: linear inside the bucket."""
        q = min(1.0, max(0.0, q))
        rank = q * self.count
        prev_bound, prev_count = 0.0, 0.0
        finite_max = 0.0
        for bound, count in self.buckets:
            if math.isinf(bound):
                return finite_max if rank > prev_count else prev_bound
            finite_max = bound
            if count >= rank and count > prev_count:
                return prev_bound + (bound - prev_bound) * (rank - prev_count) / (
                    count - prev_count
                )
            prev_bound, prev_count = bound, count
        return finite_max

    def cdf(self, seconds: float) -> float:
        """Fraction of observations at or below ``seconds`` (linear inside a bucket)."""
        total = self.count
        prev_bound, prev_count = 0.0, 0.0
        for bound, count in self.buckets:
            if math.isinf(bound):
                return prev_count / total
            if seconds < bound:
                frac = max(0.0, seconds - prev_bound) / (bound - prev_bound)
                return (prev_count + frac * (count - prev_count)) / total
            prev_bound, prev_count = bound, count
        return prev_count / total

    def mean(self) -> float:
        """The mean (from ``sum_s`` when known, else from bucket midpoints)."""
        return self._mean

    def _compute_mean(self) -> float:
        if self.sum_s is not None and self.count > 0.0:
            return self.sum_s / self.count
        total, prev_bound, prev_count = 0.0, 0.0, 0.0
        for bound, count in self.buckets:
            upper = prev_bound if math.isinf(bound) else bound
            total += (count - prev_count) * (prev_bound + upper) / 2.0
            prev_bound, prev_count = upper, count
        return total / self.count


def needed_hit_ratio_for(
    target_s: float, hits: LatencyDist | None, misses: LatencyDist, q: float = 0.95
) -> float | None:
    """The smallest hit ratio whose hit/miss mix has its ``q`` quantile within ``target_s``.

    The mix is within the target for ``h * F_hit(t) + (1 - h) * F_miss(t)``
    of requests; that reaches ``q`` from ``h = (q - F_miss) / (F_hit - F_miss)``.
    Unknown hit latency counts as always within the target (hits are fast).
    None when no hit ratio reaches it.
    """
    f_miss = misses.cdf(target_s)
    if f_miss >= q:
        return 0.0
    f_hit = 1.0 if hits is None else hits.cdf(target_s)
    if f_hit < q or f_hit <= f_miss:
        return None
    return min(1.0, (q - f_miss) / (f_hit - f_miss))


def predicted_p95(
    hit_ratio: float, hits: LatencyDist | None, misses: LatencyDist | None, q: float = 0.95
) -> float | None:
    """The ``q`` quantile of latency when a ``hit_ratio`` share of requests hit.

    With hits faster than every miss, the slowest ``1 - q`` of requests are
    all misses while the miss share exceeds them: the quantile is the miss
    distribution's ``(q - h) / (1 - h)`` quantile; otherwise the hits'
    ``q / h`` quantile. None when the needed distribution is unknown.
    """
    h = min(1.0, max(0.0, hit_ratio))
    if h < q:
        if misses is None:
            return None
        return misses.quantile((q - h) / (1.0 - h))
    if hits is None:
        return 0.0
    return hits.quantile(q / h if h > 0 else 1.0)
