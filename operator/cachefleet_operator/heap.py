"""The operator's process keeps the memory it frees, for its next rebalance.

An allocation for thousands of tenants works on numpy matrices of a few MB
(10,000 tenants x 46 curve points: 3.7 MB each). glibc's malloc serves
blocks that large as fresh mappings and gives them back to the kernel when
they are freed, so every rebalance touches its ~16 MB of temporaries as new
pages: about 4,000 page faults at 10,000 tenants, each a few microseconds
on a virtual machine (4 µs on the machines this was measured on), a quarter
of the allocation's time. Raising malloc's mmap threshold (blocks up to it
come from the heap) and trim threshold (free memory the heap's top may keep)
lets the next rebalance reuse the same pages.

The price: the process keeps up to :data:`TRIM_THRESHOLD` of freed heap at
its top instead of returning it (its peak stays resident). Settings given
in the environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
glibc's own) win: nothing is changed then. Other C libraries (no
``mallopt``) are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

#: Blocks up to this size come from the heap, not from a mapping of their own.
MMAP_THRESHOLD = 32 << 20
#: Freed memory the heap's top may keep before it is given back.
TRIM_THRESHOLD = 128 << 20
#: glibc's ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: The environment variables through which glibc takes the same settings.
_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Set malloc's thresholds (above) for this process; whether they were set.

    False when the environment already sets them, or the C library has no
    ``mallopt`` (not glibc), or it refuses a value.
    """
    if any(name in os.environ for name in _ENVIRONMENT):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done: bool = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    done = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and done
    if done:
        log.debug(
            "malloc keeps freed memory: mmap threshold %d MiB, trim threshold %d MiB",
            MMAP_THRESHOLD >> 20,
            TRIM_THRESHOLD >> 20,
        )
    return done
