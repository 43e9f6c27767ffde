"""The operator's process keeps freed memory: a rebalance's matrices reuse pages.

Counted, not timed: the page faults of making again matrices just freed,
in a fresh process with and without
:func:`~cachefleet_operator.heap.keep_freed_memory`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cachefleet_operator import heap

#: A fresh process: the page faults of five rebalance-like rounds (three 3.7 MB
#: temporaries each, made from one another, then freed), after a first one, as JSON.
_SCRIPT = """
import json, resource, sys
import numpy as np
from cachefleet_operator import heap
kept = heap.keep_freed_memory() if sys.argv[1] == "keep" else False
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ys = np.ones((10000, 46))
def rebalance():
    a = ys * 2.0
    b = a - 1.0
    return float((b / 3.0).sum())
rebalance()
before = faults()
for _ in range(5):
    rebalance()
print(json.dumps({"kept": kept, "faults": faults() - before}))
"""


def _faults(mode: str, env: dict[str, str] | None = None) -> tuple[bool, int]:
    """(whether the process set malloc's thresholds, its page faults)."""
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    )
    found = json.loads(out.stdout)
    return bool(found["kept"]), int(found["faults"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_matrix_made_again_reuses_the_freed_pages() -> None:
    _, by_default = _faults("default")
    kept, when_kept = _faults("keep")
    assert kept
    # 5 x 3 x 3.7 MB is 13,500 pages: with glibc's defaults most are faulted in again
    assert by_default > 5000
    assert when_kept < 100


def test_settings_in_the_environment_win() -> None:
    env = {"MALLOC_TRIM_THRESHOLD_": str(1 << 20)}
    assert _faults("keep", env)[0] is False


def test_thresholds_hold_a_rebalance_of_ten_thousand_tenants() -> None:
    # a 10,000 x 46 matrix of doubles (3.7 MB), with room for several alive at once
    assert heap.MMAP_THRESHOLD >= 10_000 * 46 * 8 * 4
    assert heap.TRIM_THRESHOLD >= 2 * heap.MMAP_THRESHOLD
