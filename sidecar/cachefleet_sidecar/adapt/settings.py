"""The adapt room's settings: class-aware admission, miss-ratio curves, policy switching.

The sidecar's command line (the top floor) fills this record; the room's code
reads it, never the whole sidecar configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachefleet_common.contract.fleet import FLEET_SAMPLE_RATE
from cachefleet_common.sampling import DEFAULT_MAX_RATE, DEFAULT_MAX_SAMPLES
from cachefleet_sidecar.adapt.admission import AdmissionConfig
from cachefleet_sidecar.adapt.switching import DEFAULT_WINDOW_S


@dataclass(frozen=True, slots=True)
class AdaptSettings:
    """What the sidecar measures and how it adapts to it."""

    #: Class-aware admission (docs/admission.md); None: off.
    admission: AdmissionConfig | None = None
    #: The model server's metrics URL admission reads (empty: the upstream's /metrics).
    admission_metrics_url: str = ""
    #: Window of the policy switching engine, seconds; 0 turns switching off.
    switch_window_s: float = DEFAULT_WINDOW_S
    #: Keys tracked per tenant for its miss-ratio curve (0: no curves).
    mrc_samples: int = DEFAULT_MAX_SAMPLES
    #: Highest share of a tenant's keys its curve samples (the hit path's cost bound).
    mrc_max_rate: float = DEFAULT_MAX_RATE
    #: Share of the key space whose accesses go to the fleet-sample stream (the same on
    #: every pod of a cache: the InferenceCache's spec.fleetSampleRate, set by the webhook).
    fleet_sample_rate: float = FLEET_SAMPLE_RATE
