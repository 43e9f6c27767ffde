"""The fill by gain at one utility level, all tenants at once: the bisection over levels that
finds where the greedy's grants stop fitting (:func:`_fill`), so :func:`~.greedy._greedy`
finishes in a few steps instead of one per hull segment."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from cachefleet_operator.allocation.model import EPS
from cachefleet_operator.curves import (
    BoolArray,
    CurveTable,
    FloatArray,
    IntArray,
)

#: Bisection steps of :func:`_fill_level` (over a 1e12 range of levels: 2.6e-5 apart).
FILL_LEVEL_STEPS = 20
#: How far (log of the level) :func:`_fill_level` looks on either side of its estimate when
#: the estimate's bracket misses the level: each a full pass over every row.
_LEVEL_WIDENING = (1e-4, 1e-2, 1.0)


def _prefixes(counts: IntArray, width: int) -> BoolArray:
    """``np.arange(width) < counts[:, None]`` (every count in 0..width): each row copied
    from a table of the width + 1 such rows, not compared column by column (numpy
    compares short rows broadcast against a column at a tenth of the speed)."""
    table = np.arange(width) < np.arange(width + 1)[:, None]
    out: BoolArray = np.take(table, counts, axis=0)
    return out


class _Level(NamedTuple):
    """Every row's share and choice at one level (its log), and whether their total fits."""

    at: float
    shares: FloatArray
    picks: IntArray
    fits: bool


def _fill_level(
    table: CurveTable, values: FloatArray, lo: FloatArray, hi: FloatArray, capacity: int
) -> FloatArray:
    """:func:`_fill`'s shares."""
    return _fill(table, values, lo, hi, capacity)[0]


def _fill(
    table: CurveTable, values: FloatArray, lo: FloatArray, hi: FloatArray, capacity: int
) -> tuple[FloatArray, tuple[BoolArray, float] | None]:
    """Shares from ``lo`` (up to ``hi``) at the lowest utility level that still fits, and
    what it tells :func:`_greedy` (its ``within``; None: nothing).

    At a level λ (utility per share) each tenant takes the curve point (or
    ``lo`` or ``hi``) maximising ``value · hit - λ · share``: the vertices of
    its concave hull whose segments are steeper than λ. The greedy grants
    hull segments steepest first, so the shares at the lowest λ whose total
    fits (found by bisection, all tenants at once) are what it would have
    granted before the first segment that no longer fits; :func:`_greedy`
    finishes from there in a few steps instead of one per segment.

    The bisection's path (its levels are midpoints, each decided by whether
    the total fits) is fixed by where the total first fits, and the total
    only falls as the level rises. So an estimate of that level from every
    tenant's hull segments (:class:`_Segments`) predicts the path; the two
    ends of its last bracket are computed exactly, and every decision on the
    path follows from them. Where the estimate misses, each level still
    undecided is computed exactly, each tenant only between its choices at
    the nearest levels known on either side. The shares are those of
    computing every level of the path over every tenant, bit for bit
    (tested against such a full scan). A tenant whose choice is the same at
    a lower level known (exactly) takes there what it takes at the level
    found: none of its extensions from it is steeper than that lower level,
    which the greedy is told (the tenants whose choice moves, and that level).
    """
    return _LevelSearch(table, values, lo, hi, float(capacity)).run()


class _LevelSearch:
    """One :func:`_fill`: every tenant's candidates and their gains, the levels computed
    exactly so far, and the bisection over levels (in logs)."""

    def __init__(
        self, table: CurveTable, values: FloatArray, lo: FloatArray, hi: FloatArray, cap: float
    ) -> None:
        self.table, self.values, self.lo, self.hi = table, values, lo, hi
        self.rows, self.width = table.rows, table.xs.shape[1]
        # the candidates: each row's sizes strictly between lo and hi (ascending: a run of
        # columns, first to last - 1)
        self.row: FloatArray | None = None
        if table.shared_xs is not None:
            self.row = row = table.shared_xs / cap
            self.xs: FloatArray = np.broadcast_to(row, table.xs.shape)
            first = np.searchsorted(row, lo, side="right")
            last = np.searchsorted(row, hi, side="left")
        else:
            self.xs = table.xs / cap
            first = np.count_nonzero(self.xs <= lo[:, None], axis=1)
            last = np.count_nonzero(self.xs < hi[:, None], axis=1)
        self.outside = _prefixes(first, self.width) | ~_prefixes(last, self.width)
        # values x hit ratio of every candidate, the part of each score no level changes
        self.gains = values[:, None] * table.ys
        self.gains[self.outside] = -np.inf  # never chosen
        self.at_lo, self.at_hi = table.at(lo * cap), table.at(hi * cap)
        self.gain_lo, self.gain_hi = values * self.at_lo, values * self.at_hi
        self.flat_gains = self.gains.ravel()
        # one matrix for the scores, the chords and the steps (C order: read flat too)
        self.work = np.empty(self.gains.shape)
        #: Levels computed exactly so far, by level.
        self.known: list[_Level] = []
        #: The bisection's first bracket (logs) and each row's steepest step from ``lo``.
        self.low = self.high = 0.0
        self.steepest: FloatArray = np.zeros(0)

    def size(self, at: IntArray, col: IntArray) -> FloatArray:
        """The sizes of rows ``at`` in columns ``col``."""
        return self.row[col] if self.row is not None else self.xs[at, col]

    def choose(
        self, level: float, at: IntArray, inner: FloatArray, col: IntArray
    ) -> tuple[FloatArray, IntArray]:
        """(shares, choices) of rows ``at`` from their best column's score and index: -1
        for ``lo``, the column, or ``width`` for ``hi``, whichever scores best (first on
        ties)."""
        lo, hi, width = self.lo, self.hi, self.width
        best_lo = self.gain_lo[at] - level * lo[at]
        best_hi = self.gain_hi[at] - level * hi[at]
        to_lo = ~(inner > best_lo)
        to_hi = best_hi > np.maximum(best_lo, inner)
        got = np.where(to_hi, hi[at], np.where(to_lo, lo[at], self.size(at, col)))
        return got, np.where(to_hi, width, np.where(to_lo, -1, col))

    def take_every(self, level: float) -> tuple[FloatArray, IntArray]:
        """Every row's (share, choice) at ``level``, scoring every column."""
        # (one row of sizes when shared: no matrix of them)
        scaled = level * (self.row if self.row is not None else self.xs)
        score = np.subtract(self.gains, scaled, out=self.work)
        k = np.argmax(score, axis=1)  # the first best: the smallest share on a tie
        return self.choose(level, self.rows, score[self.rows, k], k)

    def take(
        self, level: float, at: IntArray, lower: IntArray, upper: IntArray, into: _Level
    ) -> None:
        """Rows ``at``'s shares and choices at ``level`` into ``into``'s arrays, scoring
        each row's columns ``lower`` to ``upper`` only (all rows' cells in one flat array),
        or every cell while most rows still move (gathering would cost more)."""
        spans = upper - lower + 1
        total = int(spans.sum())
        if total == 0:
            return
        if 2 * total > self.gains.size:
            every, their = self.take_every(level)
            into.shares[at], into.picks[at] = every[at], their[at]
            return
        starts = np.cumsum(spans) - spans
        cols = np.repeat(lower - starts, spans) + np.arange(total)
        owners = np.repeat(at, spans)
        score = self.flat_gains[owners * self.width + cols] - level * self.size(owners, cols)
        best = np.maximum.reduceat(score, starts)
        # the first best of each row (as argmax: the smallest share on a tie)
        found = np.flatnonzero(score == np.repeat(best, spans))
        col = cols[found[np.searchsorted(found, starts)]]
        into.shares[at], into.picks[at] = self.choose(level, at, best, col)

    def evaluate(self, at: float) -> _Level:
        """Every row at level ``exp(at)``, exactly. A tenant's choice only moves to smaller
        shares as the level rises: one that takes the same at the nearest known levels on
        either side takes it in between, and the others take a column between those two
        levels' (-1 and width: lo and hi, which are always weighed)."""
        below = [k for k in self.known if k.at < at]
        above = [k for k in self.known if k.at > at]
        level = math.exp(at)
        if below and above:
            under, over = below[-1], above[0]
            moving = np.flatnonzero(under.picks != over.picks)
            found = _Level(at, over.shares.copy(), over.picks.copy(), False)
            lower = np.maximum(over.picks[moving], 0)
            upper = np.minimum(under.picks[moving], self.width - 1)
            self.take(level, moving, lower, upper, found)
        else:
            shares, picks = self.take_every(level)
            found = _Level(at, shares, picks, False)
        found = found._replace(fits=float(found.shares.sum()) <= 1.0)
        self.known.insert(len(below), found)
        return found

    def fits(self, at: float) -> bool:
        """Whether the total fits at level ``exp(at)``: from the known levels where they
        decide it, else computed."""
        for k in self.known:
            if (k.fits and k.at <= at) or (not k.fits and k.at >= at):
                return k.fits
        return self.evaluate(at).fits

    def keeps_lo(self, top: float) -> float:
        """A level where every tenant keeps ``lo``: twice the steepest step from it (the top
        of the bracket when a curve is steeper near ``lo`` than its chord to its best)."""
        return math.log(2.0 * float(np.nanmax(self.steepest, initial=top)))

    def bracket(self, decide: Callable[[float], bool], top: float) -> tuple[float, float] | None:
        """The bisection's last bracket (its low and high ends, as logs) with the
        decisions ``decide`` makes; None where the lowest level fits."""
        if decide(self.low):
            return None
        lower, upper = self.low, self.high if decide(self.high) else self.keeps_lo(top)
        for _ in range(FILL_LEVEL_STEPS):
            mid = (upper + lower) / 2.0
            if decide(mid):
                upper = mid
            else:
                lower = mid
        return lower, upper

    def run(self) -> tuple[FloatArray, tuple[BoolArray, float] | None]:
        """:func:`_fill`'s answer: the estimate's bracket computed first, then the
        bisection decided from the levels known."""
        lo, hi, values, table = self.lo, self.hi, self.values, self.table
        with np.errstate(invalid="ignore", divide="ignore"):
            spread = np.maximum(self.at_hi, table.max_hit) - self.at_lo
            slopes = values * spread / np.maximum(hi - lo, EPS)
        top = float(np.max(slopes, initial=0.0))
        if top <= 0.0 or not math.isfinite(top):
            return lo, None
        # (in logs where a tiny top's 1e-12 would underflow)
        bottom = math.log(top * 1e-12) if top * 1e-12 > 0.0 else math.log(top) + math.log(1e-12)
        self.high, self.low = math.log(top * 2.0), bottom
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            # each candidate's chord from ``lo`` (-inf elsewhere)
            chords = np.subtract(self.gains, self.gain_lo[:, None], out=self.work)
            chords /= self.xs - lo[:, None]
        chords[self.outside] = -np.inf
        reach = np.argmax(chords, axis=1)  # the first steepest chord's candidate
        chord = chords[self.rows, reach]
        with np.errstate(invalid="ignore"):  # (each row's steepest chord: the one argmax found)
            self.steepest = np.fmax(np.maximum(chord, 0.0), slopes)
        segments = _Segments(self.gains, self.xs, reach, chord, lo, self.work)
        guess = segments.guess(1.0 - float(lo.sum()))
        if math.isfinite(guess):
            self.compute_around(guess, top)
        end = self.bracket(self.fits, top)
        at = self.low if end is None else end[1]
        found = next((k for k in self.known if k.at == at), None) or self.evaluate(at)
        under = [k for k in self.known if k.at < at]
        if end is None or not under:
            return found.shares, None
        return found.shares, (under[-1].picks != found.picks, math.exp(under[-1].at))

    def compute_around(self, guess: float, top: float) -> None:
        """The two ends of the bracket the estimate ``guess`` predicts, computed exactly,
        and where it missed, levels on either side of it until one fits and one does not."""
        predicted = self.bracket(lambda at: at >= guess, top)
        for at in (self.low,) if predicted is None else predicted:
            self.evaluate(at)
        for step in _LEVEL_WIDENING:  # the estimate missed: known levels on either side
            fitting = [k.fits for k in self.known]
            if all(fitting) == any(fitting):
                self.evaluate(guess - step if all(fitting) else guess + step)


class _Segments:
    """Every tenant's hull, as segments, for an estimate of the level at which the shares of
    :func:`_fill_level` fit.

    A tenant's segments: the chord from ``lo`` to its steepest point (``reach``, with
    slope ``chord``), then from point to point up to its last candidate (``gains`` is
    -inf past it); a segment is taken at every level below its slope. Exact where a
    curve is concave past its steepest chord (but for rounding).
    """

    def __init__(
        self,
        gains: FloatArray,
        xs: FloatArray,
        reach: IntArray,
        chord: FloatArray,
        lo: FloatArray,
        work: FloatArray,
    ) -> None:
        n, width = gains.shape
        steps = work[:, : width - 1]
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            gaps = np.diff(xs[:1] if xs.strides[0] == 0 else xs, axis=1)  # a row when shared
            # every neighbours' difference in one run over the flat matrices (-inf - -inf:
            # outside); the one across the end of each row falls outside ``steps``
            flat = gains.reshape(-1)
            np.subtract(flat[1:], flat[:-1], out=work.reshape(-1)[:-1])
            steps /= gaps
        # segment k (ending at column k + 1) from k = reach on; one ending past the last
        # candidate is never steeper than a level (-inf - x is -inf, -inf - -inf NaN)
        self.after = ~_prefixes(reach, width - 1)
        self.steps, self.gaps = steps, np.broadcast_to(gaps, steps.shape)
        with np.errstate(invalid="ignore"):
            chorded = (chord > 0.0) & np.isfinite(chord)
        self.chord = chord[chorded]
        self.reached = (xs[np.arange(n), reach] - lo)[chorded]

    def around(self, lower: float, upper: float) -> tuple[float, FloatArray, FloatArray]:
        """The width of every segment steeper than ``upper``, and the (slopes, widths) of
        those with a slope in (lower, upper]: one look at every segment."""
        with np.errstate(invalid="ignore"):
            steeper = (self.steps > upper) & self.after
            inside = (self.steps > lower) & self.after & ~steeper
        chords = (self.chord > lower) & (self.chord <= upper)
        taken = float(np.sum(self.gaps, where=steeper)) + float(
            self.reached[self.chord > upper].sum()
        )
        slopes = np.concatenate([self.steps[inside], self.chord[chords]])
        widths = np.concatenate([self.gaps[inside], self.reached[chords]])
        return taken, slopes, widths

    def guess(self, need: float) -> float:
        """The log of the slope of the segment whose taking makes the widths taken exceed
        ``need``, segments taken steepest first (+inf: ``need`` < 0; the last one's when
        none does)."""
        if need < 0.0:
            return math.inf
        # where a sample of the rows overflows, then every segment near that
        step = max(1, self.steps.shape[0] // _GUESS_SAMPLE)
        sample = _Segments.__new__(_Segments)
        sample.steps, sample.gaps = self.steps[::step], self.gaps[::step]
        sample.after = self.after[::step]
        sample.chord, sample.reached = self.chord[::step], self.reached[::step]
        near = _overflowing(*sample.around(0.0, math.inf)[1:], need / step, 0.0)
        for spread in _GUESS_SPREADS:
            taken, slopes, widths = self.around(near / spread, near * spread)
            if taken > need or taken + float(widths.sum()) <= need:
                continue
            return math.log(_overflowing(slopes, widths, need, taken))
        _, slopes, widths = self.around(0.0, math.inf)
        if float(widths.sum()) <= need:
            return -math.inf
        return math.log(_overflowing(slopes, widths, need, 0.0))


#: Rows :meth:`_Segments.guess` reads first, to estimate where to look among all.
_GUESS_SAMPLE = 500
#: How far (a factor of the slope) :meth:`_Segments.guess` looks around the sample's
#: estimate, in turn, before it looks at every segment.
_GUESS_SPREADS = (1.05, 1.3, 3.0)


def _overflowing(slopes: FloatArray, widths: FloatArray, need: float, taken: float) -> float:
    """The slope of the segment whose taking makes ``taken`` plus the widths taken exceed
    ``need``, steepest first (the last one when none does)."""
    if slopes.size == 0:
        return 1.0
    order = np.argsort(-slopes)  # (ties in any order: the same slope)
    k = int(np.searchsorted(taken + np.cumsum(widths[order]), need, side="right"))
    return float(slopes[order[min(k, order.size - 1)]])
