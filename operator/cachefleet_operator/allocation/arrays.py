"""Array helpers of the allocation: attributes as columns, None and NaN, without a Python
step per tenant."""

from __future__ import annotations

import math
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from cachefleet_operator.curves import (
    BoolArray,
    FloatArray,
)


def _attr(items: Iterable[object], name: str | attrgetter[Any]) -> list[Any]:
    """``[item.<name> for item in items]``, without a Python step per item."""
    return list(map(attrgetter(name) if isinstance(name, str) else name, items))


def _numbers(items: Iterable[object], name: str) -> FloatArray:
    """The attribute ``name`` of every item as floats, ``None`` as NaN."""
    values = _attr(items, name)
    try:  # without a None, the same floats without numpy's look at every item's type first
        return np.fromiter(values, dtype=np.float64, count=len(values))
    except TypeError:  # a None
        return np.array(values, dtype=np.float64)


def _floats(values: list[float | None]) -> FloatArray:
    """An array with ``None`` and non-finite values as NaN."""
    out = np.array(values, dtype=np.float64)
    out[~np.isfinite(out)] = np.nan
    return out


def _or_none(values: npt.NDArray[Any], keep: BoolArray) -> list[Any]:
    """The values as Python objects where ``keep``, None elsewhere."""
    out = np.full(values.shape, None, dtype=object)
    out[keep] = values[keep]
    return out.tolist()  # type: ignore[no-any-return]


def _or_nan(value: np.float64) -> float | None:
    """A column's value as a float, None for NaN."""
    out = float(value)
    return None if math.isnan(out) else out


def _finite(values: FloatArray) -> FloatArray:
    """A copy with non-finite values as NaN."""
    out = values.copy()
    out[~np.isfinite(out)] = np.nan
    return out
