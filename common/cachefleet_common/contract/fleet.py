"""The fleet-sample stream's format: what a sidecar forwards for the fleet-wide curves.

Every sidecar forwards the accesses of the keys whose sampling hash (the bits the
miss-ratio curves sample by, :mod:`cachefleet_sidecar.adapt.mrc`) is below one fleet-wide
threshold: every pod samples the same keys, so the operator can replay them as one
key stream and measure the reuse the whole fleet sees (L2 answers a key's first
access on a pod). One stream entry (:func:`~cachefleet_common.contract.names.fleet_samples_key`)
is one batch of one pod, field ``b``::

    {"pod": P, "thr": threshold, "t0": unix ms, "s": {tenant: [key, size, dt_ms, ...]}}

where ``key`` is the upper 64 bits of the 128-bit key digest (its low 24 bits are the
sampling hash) and ``dt_ms`` the access's time after ``t0``. The operations that
write and read the stream are in :mod:`cachefleet_common.contract.ops`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import orjson

from cachefleet_common.contract.names import valid_name

#: Fraction of the key space every sidecar forwards by default (``--fleet-sample-rate``,
#: the InferenceCache's ``spec.fleetSampleRate``: the same on every pod of a cache). Each
#: batch carries its pod's threshold (``thr``), which the operator's replay scales by.
FLEET_SAMPLE_RATE = 1 / 16
#: Batches the stream keeps (XADD MAXLEN ~): a bound on its memory, not a window.
FLEET_STREAM_MAXLEN = 600
#: Accesses one batch carries at most; more in one flush interval are dropped.
FLEET_BATCH_MAX = 2048
#: How often a sidecar sends its batch, seconds.
FLEET_FLUSH_S = 1.0
#: Batches the operator reads from one stream per rebalance at most.
FLEET_READ_MAX = 6000


@dataclass(frozen=True, slots=True)
class FleetSample:
    """One forwarded access: ``key`` (upper 64 bits of the digest), bytes, unix seconds."""

    tenant: str
    key: int
    size: int
    at: float


def encode_fleet_batch(
    pod: str, threshold: int, samples: Iterable[tuple[str, int, int, float]]
) -> bytes:
    """One stream entry's payload from (tenant, digest, size, unix seconds) accesses."""
    by_tenant: dict[str, list[int]] = {}
    rows = list(samples)
    t0 = int(min((s[3] for s in rows), default=time.time()) * 1000)
    for tenant, digest, size, at in rows:
        flat = by_tenant.get(tenant)
        if flat is None:
            flat = by_tenant[tenant] = []
        flat += (digest >> 64, size, int(at * 1000) - t0)
    return orjson.dumps({"pod": pod, "thr": threshold, "t0": t0, "s": by_tenant})


def decode_fleet_batch(raw: bytes | str) -> tuple[int, list[FleetSample]]:
    """(threshold, samples) of one payload; ValueError when it is not one."""
    try:
        body = orjson.loads(raw)
        threshold, t0, groups = int(body["thr"]), int(body["t0"]), body["s"]
        out: list[FleetSample] = []
        for tenant, flat in groups.items():
            if not valid_name(tenant) or len(flat) % 3:
                raise ValueError(f"bad fleet sample group {tenant[:70]!r}")
            for i in range(0, len(flat), 3):
                key, size, dt = int(flat[i]), int(flat[i + 1]), int(flat[i + 2])
                out.append(FleetSample(tenant, key, size, (t0 + dt) / 1000.0))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a fleet sample batch: {exc}") from exc
    return threshold, out
