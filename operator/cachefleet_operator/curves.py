"""Curves the allocator reasons with: hit ratio by cache size, latency distributions (pure).

* :class:`HitCurve`: a tenant's predicted hit ratio as a function of the
  bytes it is given, from the reuse-distance histogram the sidecars export
  (:mod:`cachefleet_sidecar.adapt.mrc`), summed over pods. ``at(bytes)``
  interpolates; ``hull(lo, hi)`` is the concave majorant on a grid, the form
  a greedy allocator can use without being fooled by cliffs (a working set
  that pays off only once it fits whole: Talus, Beckmann & Sanchez HPCA'15).
* :class:`LatencyDist`: a latency histogram (Prometheus buckets); quantiles
  by linear interpolation as ``histogram_quantile`` does, and the mean.
* :func:`predicted_p95`: the p95 of the mix of hits and misses at a given
  hit ratio (hits are assumed faster than every miss).
* :class:`CurveTable` and :class:`LatencyTable`: many curves or histograms
  at once, as padded numpy matrices, with the same answers as the scalar
  methods (bit for bit), for allocating among thousands of tenants. Each
  curve and histogram keeps its numbers as raw doubles (``xs_raw``...) so a
  table is a buffer join away, not a Python loop over every point; curves
  that share their sizes (the sidecars' buckets) share one row of them.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def _doubles(values: tuple[float, ...]) -> bytes:
    return array("d", values).tobytes()


#: Curves' sizes seen so far, each kept once (the sidecars' buckets: a handful): curves with
#: the same sizes share one bytes object, so a :class:`CurveTable` finds them alike by
#: identity rather than by comparing every byte. Bounded: sizes past it are kept apart.
_SIZES: dict[bytes, bytes] = {}
_SIZES_KEPT = 64


def _shared_sizes(raw: bytes) -> bytes:
    kept = _SIZES.get(raw)
    if kept is not None:
        return kept
    if len(_SIZES) < _SIZES_KEPT:
        _SIZES[raw] = raw
    return raw


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


def interpolate(xs: Sequence[float], ys: Sequence[float], size: float) -> float:
    """The hit ratio at ``size`` of a curve through ``xs`` and ``ys`` (:meth:`HitCurve.at`)."""
    if size <= 0.0 or len(xs) < 2:
        return 0.0
    hi = bisect_right(xs, size)
    if hi >= len(xs):
        return ys[-1]
    x0, y0 = xs[hi - 1], ys[hi - 1]
    return y0 + (ys[hi] - y0) * (size - x0) / (xs[hi] - x0)


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
    #: ``xs`` and ``ys`` as raw doubles (derived, for :class:`CurveTable`).
    xs_raw: bytes = field(init=False, repr=False, compare=False)
    ys_raw: bytes = field(init=False, repr=False, compare=False)
    #: The best hit ratio at any size: the last point's (0 without points). A field, not
    #: a property, so thousands of curves are read as a column at C speed.
    max_hit_ratio: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        xs = tuple(x for x, _ in self.points)
        ys = tuple(y for _, y in self.points)
        object.__setattr__(self, "xs", xs)
        object.__setattr__(self, "ys", ys)
        object.__setattr__(self, "max_hit_ratio", ys[-1] if ys else 0.0)
        object.__setattr__(self, "xs_raw", _shared_sizes(_doubles(xs)))
        object.__setattr__(self, "ys_raw", _doubles(ys))

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
        return interpolate(self.xs, self.ys, size)

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
    #: The bounds, the cumulative counts and the mean, as one run of raw doubles
    #: (derived, for :class:`LatencyTable`: one read per histogram).
    raw: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        mean = self._compute_mean()
        object.__setattr__(self, "_mean", mean)
        bounds = tuple(b for b, _ in self.buckets)
        counts = tuple(c for _, c in self.buckets)
        object.__setattr__(self, "raw", _doubles((*bounds, *counts, mean)))

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


def _column(items: Sequence[object], name: str, default: object = None) -> list[Any]:
    """Attribute ``name`` of every item, ``default`` for None (without a Python step per item)."""
    return list(map(getattr, items, repeat(name), repeat(default)))


def _unpack(
    items: Sequence[HitCurve | LatencyDist | None], first: str, second: str
) -> tuple[FloatArray, FloatArray, IntArray]:
    """(first, second, lengths): the raw doubles ``first`` and ``second`` of every item as
    rows of two (n, K) matrices.

    Rows are padded with their last value (``first`` with +inf, so a padded
    column never compares below a size or a latency); None is an empty row:
    length 0, ``first`` all +inf and ``second`` all 0.
    """
    n = len(items)
    if not any(items):  # nothing known (e.g. no tenant's hit latency): no row to read
        return np.full((n, 1), np.inf), np.zeros((n, 1)), np.zeros(n, dtype=np.int64)
    firsts: list[bytes] = _column(items, first, b"")
    lengths = np.array(list(map(len, firsts)), dtype=np.int64) // 8
    width = max(1, int(lengths.max(initial=0)))
    flat_first = np.frombuffer(b"".join(firsts), dtype=np.float64)
    flat_second = np.frombuffer(b"".join(_column(items, second, b"")), dtype=np.float64)
    present = lengths > 0
    if int(lengths.min(where=present, initial=width)) == width:  # all alike: a reshape
        block_first, block_second = flat_first.reshape(-1, width), flat_second.reshape(-1, width)
        if present.all():
            return block_first, block_second, lengths
        rows = np.flatnonzero(present)
        out_first, out_second = np.full((n, width), np.inf), np.zeros((n, width))
        out_first[rows], out_second[rows] = block_first, block_second
        return out_first, out_second, lengths
    starts = np.cumsum(lengths) - lengths
    cols = np.arange(width)
    index = starts[:, None] + np.minimum(cols[None, :], np.maximum(lengths - 1, 0)[:, None])
    empty = lengths == 0
    index[empty] = 0
    out_first = flat_first[index]
    out_second = flat_second[index]
    out_first[cols[None, :] >= lengths[:, None]] = np.inf
    out_second[empty] = 0.0
    return out_first, out_second, lengths


def _bisect(
    matrix: FloatArray, values: FloatArray, *, right: bool, ends: IntArray | None = None
) -> IntArray:
    """Per row, ``bisect_right`` (``right``) or ``bisect_left`` of its value in the row.

    Rows are ascending (padding included); ``ends`` limits each row's search
    to its first ``ends`` columns. On such rows this counts what
    ``np.count_nonzero(matrix <= values[:, None], axis=1)`` (``<`` when not
    ``right``) counts, in log2(width) steps over the rows rather than one
    step over every cell.
    """
    n, width = matrix.shape
    # each row's cells from the flat matrix (faster than by two indices)
    flat, starts = matrix.ravel(), np.arange(0, n * width, width)
    lo = np.zeros(n, dtype=np.int64)
    hi = np.full(n, width, dtype=np.int64) if ends is None else ends.astype(np.int64)
    for _ in range(width.bit_length()):
        mid = (lo + hi) >> 1
        cell = flat[starts + np.minimum(mid, width - 1)]
        searching = lo < hi
        go_right = (cell <= values if right else cell < values) & searching
        lo = np.where(go_right, mid + 1, lo)
        hi = np.where(searching & ~go_right, mid, hi)
    return lo


def _widened(matrix: FloatArray, width: int, pad: float | None = None) -> FloatArray:
    """``matrix`` with columns added up to ``width``: ``pad``, or its last column repeated."""
    n, have = matrix.shape
    if have == width:
        return matrix
    out = np.empty((n, width))
    out[:, :have] = matrix
    out[:, have:] = matrix[:, have - 1 : have] if pad is None else pad
    return out


class CurveTable:
    """Many :class:`HitCurve` (None: no curve) as padded matrices; vectorised ``at`` and more.

    Every method answers, row by row, what the scalar code answers for that
    row's curve, with the same floating-point operations in the same order.
    """

    def __init__(self, curves: Sequence[HitCurve | None]) -> None:
        n = len(curves)
        sizes: list[bytes] = _column(curves, "xs_raw", b"")
        #: The sizes of every row when all rows have the same (curves from the sidecars'
        #: fixed buckets): one row, searched once for all rows.
        self.shared_xs: FloatArray | None = None
        if n and sizes[0] and all(map(sizes[0].__eq__, sizes)):
            self.shared_xs = np.frombuffer(sizes[0], dtype=np.float64)
            width = self.shared_xs.size
            self.xs = np.broadcast_to(self.shared_xs, (n, width))
            ys = b"".join(_column(curves, "ys_raw"))
            self.ys = np.frombuffer(ys, dtype=np.float64).reshape(n, width)
            self.length = np.full(n, width, dtype=np.int64)
        else:
            self.xs, self.ys, self.length = _unpack(curves, "xs_raw", "ys_raw")
        self.rows = np.arange(n)
        self.present = self.length > 0
        last = np.maximum(self.length - 1, 0)
        #: :attr:`HitCurve.max_hit_ratio` (0 without a curve).
        self.max_hit = np.where(self.present, self.ys[self.rows, last], 0.0)
        self.footprint = np.array(_column(curves, "footprint_bytes"), dtype=np.float64)
        #: :attr:`HitCurve.cold_ratio` (NaN without a curve) and :attr:`HitCurve.requests`
        #: (0 without a curve).
        self.cold = np.array(_column(curves, "cold_ratio"), dtype=np.float64)
        self.requests = np.array(_column(curves, "requests", 0.0), dtype=np.float64)
        self._views: dict[int, HitCurve] = {}
        self._points: dict[int, tuple[list[float], list[float]]] = {}

    @classmethod
    def _of(
        cls,
        xs: FloatArray,
        ys: FloatArray,
        length: IntArray,
        columns: tuple[FloatArray, FloatArray, FloatArray],
        shared_xs: FloatArray | None = None,
    ) -> CurveTable:
        """A table of padded matrices and its (footprint, cold, requests) columns."""
        out = object.__new__(cls)
        out.shared_xs, out.xs, out.ys, out.length = shared_xs, xs, ys, length
        out.rows = np.arange(length.size)
        out.present = length > 0
        out.max_hit = np.where(out.present, ys[out.rows, np.maximum(length - 1, 0)], 0.0)
        out.footprint, out.cold, out.requests = columns
        out._views, out._points = {}, {}
        return out

    @classmethod
    def from_histograms(
        cls, bounds: FloatArray, counts: FloatArray, requests: FloatArray, footprint: FloatArray
    ) -> CurveTable:
        """:meth:`HitCurve.from_histogram` of every row at once (no curve where it gives None).

        ``counts`` (rows x buckets) are cumulative by ``bounds``, the same for
        every row, distinct, in any order; every count finite. ``requests``
        and ``footprint`` per row, NaN where unknown. The same numbers as the
        scalar code, bit for bit.
        """
        m, k = counts.shape
        order = np.argsort(bounds, kind="stable")
        in_order = bool((order == np.arange(k)).all())  # as the sidecars send them: no copy
        b, c = (bounds, counts) if in_order else (bounds[order], counts[:, order])
        if k == 0 or not math.isinf(b[-1]):
            return cls([None] * m)
        acc = np.maximum.accumulate(c, axis=1)
        cum = np.where(acc > 0.0, acc, 0.0)  # max(0.0, ...) as the scalar code keeps it
        estimated = cum[:, -1]
        made = estimated > 0.0
        reused = cum[:, -2] > 0.0 if k > 1 else np.zeros(m, dtype=bool)
        with np.errstate(invalid="ignore"):
            use = reused & (requests > 0.0) & np.isfinite(requests)
        total = np.where(use, requests, estimated)
        adjust = np.where(use, requests - estimated, 0.0)
        ys = np.zeros((m, k))
        with np.errstate(divide="ignore", invalid="ignore"):
            hits = cum[:, :-1] + adjust[:, None]
            ratio = np.where(hits > 0.0, hits, 0.0) / total[:, None]
        ys[:, 1:] = np.where(ratio < 1.0, ratio, 1.0)
        ys[~made] = 0.0
        cold = 1.0 - ys[:, -1]
        xs_row = np.concatenate([[0.0], b[:-1]])
        columns = (
            np.where(made, footprint, np.nan),
            np.where(made, np.where(cold > 0.0, cold, 0.0), np.nan),
            np.where(made, total, 0.0),
        )
        length = np.where(made, k, 0)
        if made.all():
            return cls._of(np.broadcast_to(xs_row, (m, k)), ys, length, columns, xs_row)
        xs = np.where(made[:, None], xs_row[None, :], np.inf)
        return cls._of(xs, ys, length, columns)

    @classmethod
    def stack(cls, tables: Sequence[CurveTable]) -> CurveTable:
        """The rows of ``tables``, one after the other."""
        if len(tables) == 1:
            return tables[0]
        shared = tables[0].shared_xs
        columns = (
            np.concatenate([t.footprint for t in tables]),
            np.concatenate([t.cold for t in tables]),
            np.concatenate([t.requests for t in tables]),
        )
        length = np.concatenate([t.length for t in tables])
        if shared is not None and all(
            t.shared_xs is not None and np.array_equal(t.shared_xs, shared) for t in tables
        ):
            ys = np.concatenate([t.ys for t in tables])
            return cls._of(np.broadcast_to(shared, ys.shape), ys, length, columns, shared)
        width = max(t.xs.shape[1] for t in tables)
        xs = np.concatenate([_widened(t.xs, width, pad=np.inf) for t in tables])
        ys = np.concatenate([_widened(t.ys, width) for t in tables])
        return cls._of(xs, ys, length, columns)

    def take(self, index: IntArray) -> CurveTable:
        """A table whose row ``k`` is this table's row ``index[k]`` (-1: no curve).

        Rows are copied as they are (padding included), so every method
        answers on the new table what it answered on the old one's rows.
        """
        n = index.size
        out = object.__new__(CurveTable)
        source = self if self.rows.size else CurveTable([None])
        if not self.rows.size:
            index = np.full(n, -1, dtype=np.int64)
        src = np.maximum(index, 0)
        empty = (index < 0) | ~source.present[src]
        out.length = np.where(empty, 0, source.length[src])
        out.ys = np.take(source.ys, src, axis=0)  # (rows by take: faster than by [src])
        out.ys[empty] = 0.0
        if source.shared_xs is not None and not empty.any():
            out.shared_xs = source.shared_xs
            out.xs = np.broadcast_to(source.shared_xs, (n, source.shared_xs.size))
        else:
            out.shared_xs = None
            out.xs = np.take(source.xs, src, axis=0)  # a copy, also of a broadcast row
            out.xs[empty] = np.inf
        out.rows = np.arange(n)
        out.present = out.length > 0
        out.max_hit = np.where(empty, 0.0, source.max_hit[src])
        out.footprint = np.where(empty, np.nan, source.footprint[src])
        out.cold = np.where(empty, np.nan, source.cold[src])
        out.requests = np.where(empty, 0.0, source.requests[src])
        out._views, out._points = {}, {}
        return out

    def only(self, keep: BoolArray) -> CurveTable:
        """This table with the rows not in ``keep`` as no curve."""
        return self.take(np.where(keep, self.rows, -1))

    def points(self, row: int) -> tuple[list[float], list[float]]:
        """Row ``row``'s sizes and hit ratios (as :attr:`HitCurve.xs` and ``ys``; none: empty)."""
        found = self._points.get(row)
        if found is None:
            length = int(self.length[row])
            found = self._points[row] = (
                self.xs[row, :length].tolist(),
                self.ys[row, :length].tolist(),
            )
        return found

    def curve(self, row: int) -> HitCurve | None:
        """Row ``row`` as a :class:`HitCurve` (None: no curve); the same numbers, bit for bit."""
        if not self.present[row]:
            return None
        view = self._views.get(row)
        if view is None:
            xs, ys = self.points(row)
            footprint = float(self.footprint[row])
            view = self._views[row] = HitCurve(
                tuple(zip(xs, ys, strict=True)),
                float(self.cold[row]),
                float(self.requests[row]),
                None if math.isnan(footprint) else footprint,
            )
        return view

    def _find(self, rows: IntArray, sizes: FloatArray, *, right: bool) -> IntArray:
        """:func:`_bisect` of each of ``rows`` in its sizes."""
        if self.shared_xs is None:
            xs = self.xs if rows.size == self.rows.size else self.xs[rows]
            return _bisect(xs, sizes, right=right)
        found = np.searchsorted(self.shared_xs, sizes, side="right" if right else "left")
        return np.where(np.isnan(sizes), 0, found)  # searchsorted puts NaN last

    def at(self, sizes: FloatArray) -> FloatArray:
        """:meth:`HitCurve.at` of every row at its size (0 without a curve)."""
        return self._at(self.rows, sizes)

    def _size_at(self, rows: IntArray, cols: IntArray) -> FloatArray:
        """``xs[rows, cols]``: from the one row of sizes when every row shares it."""
        out: FloatArray = self.xs[rows, cols] if self.shared_xs is None else self.shared_xs[cols]
        return out

    def _hit_at(self, rows: IntArray, cols: IntArray) -> FloatArray:
        """``ys[rows, cols]``, gathered from the flat matrix (faster than by two indices)."""
        out: FloatArray = self.ys.ravel()[rows * self.ys.shape[1] + cols]
        return out

    def _at(self, rows: IntArray, sizes: FloatArray) -> FloatArray:
        """:meth:`at` of ``rows`` (each at its size)."""
        length = self.length if rows.size == self.rows.size else self.length[rows]
        hi = self._find(rows, sizes, right=True)
        lo = np.where(hi == 0, length - 1, hi - 1).clip(0)  # bisect's hi - 1 wraps at 0
        up = np.minimum(hi, np.maximum(length - 1, 0))
        x0, y0 = self._size_at(rows, lo), self._hit_at(rows, lo)
        x1, y1 = self._size_at(rows, up), self._hit_at(rows, up)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            inside = y0 + (y1 - y0) * (sizes - x0) / (x1 - x0)
        out = np.where(hi >= length, self._hit_at(rows, np.maximum(length - 1, 0)), inside)
        return np.where((sizes <= 0.0) | (length < 2), 0.0, out)

    def size_for(self, hit: FloatArray) -> FloatArray:
        """The smallest size whose hit ratio reaches ``hit`` per row (NaN: none does).

        Linear inside a bucket, as :meth:`at` reads it; 0 for ``hit <= 0``.
        """
        length, rows = self.length, self.rows
        k = _bisect(self.ys, hit - 1e-12, right=False, ends=length)  # the first point reaching it
        kk = np.minimum(k, np.maximum(length - 1, 0))
        prev = np.maximum(kk - 1, 0)
        x, y = self._size_at(rows, kk), self._hit_at(rows, kk)
        px = np.where(k > 0, self._size_at(rows, prev), 0.0)
        py = np.where(k > 0, self._hit_at(rows, prev), 0.0)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            size = np.where(y <= py, x, px + (x - px) * (hit - py) / (y - py))
        size = np.where(k >= length, np.nan, size)
        return np.where(hit <= 0.0, 0.0, size)

    def best_extensions(
        self, values: FloatArray, lo: FloatArray, hi: FloatArray, capacity: int, rows: IntArray
    ) -> tuple[FloatArray, FloatArray]:
        """(utility per share, new share) of the best extension of ``lo`` up to ``hi``.

        For the given ``rows``; NaN where none (``hi - lo`` too small). Candidate
        ends are every curve point strictly inside (lo, hi), then ``hi``; a
        later candidate wins only if better by more than a relative 1e-9, as
        the scalar scan in :mod:`cachefleet_operator.allocation` does.
        """
        eps = 1e-12
        values, lo, hi = values[rows], lo[rows], hi[rows]
        base = self._at(rows, lo * capacity)
        first = self._find(rows, lo * capacity, right=True)
        last = np.maximum(first, self._find(rows, hi * capacity, right=False))
        last = np.minimum(last, self.length[rows])
        ok = hi - lo > eps
        # -inf: nothing yet (every candidate's utility is finite, so the first one wins)
        best_per = np.full(rows.size, -np.inf)
        best_to = np.full(rows.size, np.nan)
        scale = 1.0 + 1e-9

        def offer(
            at: slice,
            to: FloatArray,
            hit: FloatArray,
            of: tuple[FloatArray, ...] = (values, lo, base, best_per, best_to),
        ) -> None:
            """Offer ``to`` (at ``hit``) to rows ``at`` of ``of`` (values, lo, base, and
            the best utility per share and new share so far, updated in place)."""
            value, low, base_hit, per_best, to_best = of
            gap = to - low[at]
            per = value[at] * (hit - base_hit[at]) / gap
            better = ~(gap <= eps) & (per > per_best[at] * scale)
            np.copyto(per_best[at], per, where=better)
            np.copyto(to_best[at], to, where=better)

        # a row's k-th candidate point is its column first + k: the rows with more than k
        # candidates take it together (fewer and fewer, as few rows span many points)
        count = np.where(ok & (first < last), last - first, 0)
        most = int(count.max(initial=0))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if most:
                # the rows by count, most first: those with more than k candidates are the
                # first ``more[k]``, so each step reads slices of arrays in that order, not gathers
                by = np.argsort(-count, kind="stable")
                more = np.searchsorted(-count[by], -np.arange(most), side="left").tolist()
                ranked = (values[by], lo[by], base[by], best_per[by], best_to[by])
                ranked_rows, ranked_first = rows[by], first[by]
                for k in range(most):
                    at = slice(0, more[k])
                    row, col = ranked_rows[at], ranked_first[at] + k
                    xs = self._size_at(row, col)
                    offer(at, xs / capacity, self._hit_at(row, col), ranked)
                best_per[by], best_to[by] = ranked[3], ranked[4]
            # then hi, to every row (one where ``hi - lo`` is too small takes nothing)
            offer(slice(None), hi, self._at(rows, hi * capacity))
        return np.where(best_per == -np.inf, np.nan, best_per), best_to


class LatencyTable:
    """Many :class:`LatencyDist` (None: unknown) as padded matrices; vectorised ``cdf``."""

    def __init__(self, dists: Sequence[LatencyDist | None]) -> None:
        n = len(dists)
        raws: list[bytes] = _column(dists, "raw", b"")
        doubles = np.array(list(map(len, raws)), dtype=np.int64) // 8  # 2 x buckets + 1
        self.length = np.maximum(doubles - 1, 0) // 2
        self.present = self.length > 0
        self.rows = np.arange(n)
        width = max(1, int(self.length.max(initial=0)))
        # one more +inf column: a histogram without +Inf ends its scan there
        self.bounds = np.full((n, width + 1), np.inf)
        self.counts = np.zeros((n, width + 1))
        #: :meth:`LatencyDist.mean` of every row (NaN where unknown).
        self.mean = np.full(n, np.nan)
        if not self.present.any():  # nothing known (e.g. no tenant's hit latency)
            return
        flat = np.frombuffer(b"".join(raws), dtype=np.float64)
        rows = np.flatnonzero(self.present)
        if int(self.length.min(where=self.present, initial=width)) == width:  # all alike
            block = flat.reshape(-1, 2 * width + 1)
            self.bounds[rows, :width] = block[:, :width]
            self.counts[rows, :width] = block[:, width : 2 * width]
            self.mean[rows] = block[:, 2 * width]
        else:
            length = self.length[rows]
            start = (np.cumsum(doubles) - doubles)[rows]
            cols = np.minimum(np.arange(width)[None, :], (length - 1)[:, None])
            bounds = flat[start[:, None] + cols]
            bounds[np.arange(width)[None, :] >= length[:, None]] = np.inf  # padding
            self.bounds[rows, :width] = bounds
            self.counts[rows, :width] = flat[(start + length)[:, None] + cols]
            self.mean[rows] = flat[start + 2 * length]
        self.counts[:, width] = self.counts[:, width - 1]

    @classmethod
    def from_buckets(cls, bounds: FloatArray, counts: FloatArray) -> LatencyTable:
        """:meth:`LatencyDist.from_buckets` of every row (unknown where it gives None).

        ``counts`` (rows x buckets) cumulative by ``bounds``, the same for every
        row, distinct, in any order; every count finite. Bit for bit the scalar
        code's numbers (the mean summed bucket by bucket, in order).
        """
        m, k = counts.shape
        out = object.__new__(cls)
        out.rows = np.arange(m)
        out.bounds = np.full((m, k + 1), np.inf)
        out.counts = np.zeros((m, k + 1))
        out.mean = np.full(m, np.nan)
        out.length = np.zeros(m, dtype=np.int64)
        out.present = out.length > 0
        if k == 0:
            return out
        order = np.argsort(bounds, kind="stable")
        b, c = bounds[order], counts[:, order]
        acc = np.maximum.accumulate(c, axis=1)
        cum = np.where(acc > 0.0, acc, 0.0)
        made = cum[:, -1] > 0.0
        upper = b.tolist()
        previous = 0.0
        for j, bound in enumerate(upper):  # an infinite bound's midpoint is the one before
            upper[j] = previous if math.isinf(bound) else bound
            previous = upper[j]
        tops = np.array(upper)
        lows = np.concatenate([[0.0], tops[:-1]])
        below = np.concatenate([np.zeros((m, 1)), cum[:, :-1]], axis=1)
        terms = (cum - below) * (lows + tops) / 2.0
        total = np.cumsum(np.concatenate([np.zeros((m, 1)), terms], axis=1), axis=1)[:, -1]
        with np.errstate(divide="ignore", invalid="ignore"):
            out.mean = np.where(made, total / cum[:, -1], np.nan)
        out.bounds[made, :k] = b
        out.counts[made, :k] = cum[made]
        out.counts[:, k] = out.counts[:, k - 1]
        out.length = np.where(made, k, 0)
        out.present = made
        return out

    @classmethod
    def stack(cls, tables: Sequence[LatencyTable]) -> LatencyTable:
        """The rows of ``tables``, one after the other."""
        if len(tables) == 1:
            return tables[0]
        width = max(t.bounds.shape[1] for t in tables)
        out = object.__new__(cls)
        out.bounds = np.concatenate([_widened(t.bounds, width, pad=np.inf) for t in tables])
        out.counts = np.concatenate([_widened(t.counts, width) for t in tables])
        out.mean = np.concatenate([t.mean for t in tables])
        out.length = np.concatenate([t.length for t in tables])
        out.present = out.length > 0
        out.rows = np.arange(out.length.size)
        return out

    def dist(self, row: int) -> LatencyDist | None:
        """Row ``row`` as a :class:`LatencyDist` (None: unknown); its numbers, bit for bit."""
        if not self.present[row]:
            return None
        length = int(self.length[row])
        bounds, counts = self.bounds[row, :length].tolist(), self.counts[row, :length].tolist()
        return LatencyDist(tuple(zip(bounds, counts, strict=True)))

    def take(self, index: IntArray) -> LatencyTable:
        """A table whose row ``k`` is this table's row ``index[k]`` (-1: unknown)."""
        out = object.__new__(LatencyTable)
        source = self if self.rows.size else LatencyTable([None])
        if not self.rows.size:
            index = np.full(index.size, -1, dtype=np.int64)
        src = np.maximum(index, 0)
        empty = (index < 0) | ~source.present[src]
        out.length = np.where(empty, 0, source.length[src])
        out.present = out.length > 0
        out.rows = np.arange(index.size)
        out.bounds = np.take(source.bounds, src, axis=0)  # (as CurveTable.take)
        out.bounds[empty] = np.inf
        out.counts = np.take(source.counts, src, axis=0)
        out.counts[empty] = 0.0
        out.mean = np.where(empty, np.nan, source.mean[src])
        return out

    def cdf(self, seconds: FloatArray) -> FloatArray:
        """:meth:`LatencyDist.cdf` of every row at its ``seconds`` (NaN where unknown)."""
        bounds, counts = self.bounds, self.counts
        total = counts[:, -1]
        stop = np.isinf(bounds) | (seconds[:, None] < bounds)
        j = np.argmax(stop, axis=1)  # the +inf column guarantees a stop
        prev = np.maximum(j - 1, 0)
        # cells of the flat matrices (faster than by two indices)
        flat_bounds, flat_counts, starts = bounds.ravel(), counts.ravel(), self.rows * stop.shape[1]
        prev_bound = np.where(j > 0, flat_bounds[starts + prev], 0.0)
        prev_count = np.where(j > 0, flat_counts[starts + prev], 0.0)
        bound, count = flat_bounds[starts + j], flat_counts[starts + j]
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.maximum(0.0, seconds - prev_bound) / (bound - prev_bound)
            inside = (prev_count + frac * (count - prev_count)) / total
            out = np.where(np.isinf(bound), prev_count / total, inside)
        return np.where(self.present, out, np.nan)
