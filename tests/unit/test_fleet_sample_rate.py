"""spec.fleetSampleRate: from the CRD to every sidecar of the cache, and the operator's replay
scaled by the rate the sidecars actually used (issue 26)."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachefleet_common.contract.fleet import (
    FLEET_SAMPLE_RATE,
    FleetSample,
    decode_fleet_batch,
    encode_fleet_batch,
)
from cachefleet_operator import injection
from cachefleet_operator.api import SpecError, parse_spec
from cachefleet_operator.fleet import FleetCurves
from cachefleet_sidecar import config as sidecar_config
from cachefleet_sidecar.adapt.mrc import MissRatioCurves

from .crd_schema import spec_errors

EXAMPLE = Path(__file__).parents[2] / "examples" / "inferencecache.yaml"
CACHE = "ns/chat"
WINDOW_S = 3600.0


def spec(**fields: Any) -> dict[str, Any]:
    raw: dict[str, Any] = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["spec"])
    raw.update(fields)
    return raw


def schema_errors(raw_spec: dict[str, Any]) -> list[str]:
    return spec_errors(raw_spec)


def sidecar_env(raw_spec: dict[str, Any]) -> dict[str, str]:
    info = injection.cache_info({"metadata": {"namespace": "ns", "name": "chat"}, "spec": raw_spec})
    settings = injection.SidecarSettings.model_validate({"image": "cachefleet:test"})
    container = injection.sidecar_container(info, settings)
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_the_rate_flows_from_the_crd_to_the_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_spec(spec()).fleet_sample_rate == FLEET_SAMPLE_RATE
    assert parse_spec(spec(fleetSampleRate=0.25)).fleet_sample_rate == 0.25
    assert schema_errors(spec(fleetSampleRate=1)) == []
    env = sidecar_env(spec(fleetSampleRate=0.25))
    assert env["CACHEFLEET_FLEET_SAMPLE_RATE"] == "0.25"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert sidecar_config.parse_args([]).adapt.fleet_sample_rate == 0.25


def test_the_charts_sidecar_env_cannot_give_a_pod_another_rate() -> None:
    info = injection.cache_info(
        {"metadata": {"namespace": "ns", "name": "chat"}, "spec": {"fleetSampleRate": 0.5}}
    )
    settings = injection.SidecarSettings.model_validate(
        {"image": "cachefleet:test", "env": {"CACHEFLEET_FLEET_SAMPLE_RATE": "1"}}
    )
    env = injection.sidecar_container(info, settings)["env"]
    assert [e["value"] for e in env if e["name"] == "CACHEFLEET_FLEET_SAMPLE_RATE"] == ["0.5"]


def test_every_injected_pod_is_given_the_rate_even_without_the_field() -> None:
    # an old object without the field (no API-server default): the default, said outright,
    # so a sidecar image with another default still forwards the same keys as the others
    assert sidecar_env({})["CACHEFLEET_FLEET_SAMPLE_RATE"] == repr(FLEET_SAMPLE_RATE)
    assert sidecar_config.parse_args(["--upstream", "http://m:8000"]).adapt.fleet_sample_rate == (
        FLEET_SAMPLE_RATE
    )


@pytest.mark.parametrize("rate", [0, -0.5, 1.5, "often"])
def test_a_bad_rate_is_refused_naming_the_field(rate: object) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(spec(fleetSampleRate=rate))
    assert caught.value.field == "spec.fleetSampleRate"
    assert "spec.fleetSampleRate" in schema_errors(spec(fleetSampleRate=rate))
    # the webhook never fails a Pod for it (the API server refuses such an object anyway)
    assert sidecar_env(spec(fleetSampleRate=rate))["CACHEFLEET_FLEET_SAMPLE_RATE"] == repr(
        FLEET_SAMPLE_RATE
    )


@pytest.mark.parametrize("value", ["0", "1.01", "nan", "x"])
def test_the_sidecar_refuses_a_bad_rate_naming_the_flag(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        sidecar_config.parse_args(["--upstream", "http://m:8000", "--fleet-sample-rate", value])
    assert "--fleet-sample-rate" in capsys.readouterr().err


def batches_at(
    rate: float, keys: list[int], rounds: int, start: float
) -> list[tuple[int, list[FleetSample]]]:
    """``rounds`` passes over ``keys`` on one pod forwarding at ``rate``, as streamed."""
    now = [start]
    pod = MissRatioCurves(budget_per_s=1e12, clock=lambda: now[0])
    pod.forward_fleet(rate, 10**9, wall=lambda: now[0])
    for _ in range(rounds):
        for key in keys:
            pod.access("search", key, 1000)
            now[0] += 0.001
    taken = pod.take_fleet_samples()
    return [decode_fleet_batch(encode_fleet_batch("pod-0", pod.fleet_threshold, taken))]


@pytest.mark.parametrize("rate", [1 / 64, 1 / 4, 1.0])
def test_the_replay_scales_by_the_rate_the_sidecars_used(rate: float) -> None:
    rng = random.Random(7)
    keys = [rng.getrandbits(128) for _ in range(3000)]
    fleet = FleetCurves()
    used = fleet.ingest(CACHE, batches_at(rate, keys, 2, 1.7e9), None, rate=rate)
    assert used == pytest.approx(rate * 2 * len(keys), rel=0.35)
    curve = fleet.curves(CACHE, WINDOW_S)["search"]
    # each sample weighs 1/rate: the requests behind the curve are the pod's
    assert curve.requests * WINDOW_S == pytest.approx(2 * len(keys), rel=0.35)
    assert curve.max_hit_ratio == pytest.approx(0.5, abs=0.1)


def test_a_raised_rate_is_used_once_no_pod_forwards_less() -> None:
    rng = random.Random(8)
    keys = [rng.getrandbits(128) for _ in range(3000)]
    fleet = FleetCurves()
    fleet.ingest(CACHE, batches_at(1 / 16, keys, 1, 1.7e9), None, rate=1 / 16)
    # the spec now says 1/4; pods still at 1/16 forward a subset: the trackers keep to it
    used = fleet.ingest(CACHE, batches_at(1 / 16, keys, 1, 1.7e9 + 10), None, rate=1 / 4)
    assert used == pytest.approx(len(keys) / 16, rel=0.35)
    assert fleet.curves(CACHE, WINDOW_S)["search"].max_hit_ratio > 0.3  # the reuse is seen
    # a read with only pods at 1/4: the trackers start over, at 1/4
    used = fleet.ingest(CACHE, batches_at(1 / 4, keys, 1, 1.7e9 + 20), None, rate=1 / 4)
    assert used == pytest.approx(len(keys) / 4, rel=0.35)
    assert fleet.curves(CACHE, WINDOW_S)["search"].max_hit_ratio == 0.0  # started over
    used = fleet.ingest(CACHE, batches_at(1 / 4, keys, 1, 1.7e9 + 30), None, rate=1 / 4)
    assert used == pytest.approx(len(keys) / 4, rel=0.35)
    curve = fleet.curves(CACHE, WINDOW_S)["search"]
    assert curve.requests * WINDOW_S == pytest.approx(2 * len(keys), rel=0.35)
    assert curve.max_hit_ratio == pytest.approx(0.5, abs=0.1)


def test_a_lowered_rate_lowers_the_trackers_without_starting_over() -> None:
    rng = random.Random(9)
    keys = [rng.getrandbits(128) for _ in range(4000)]
    fleet = FleetCurves()
    fleet.ingest(CACHE, batches_at(1 / 4, keys, 1, 1.7e9), None, rate=1 / 4)
    used = fleet.ingest(CACHE, batches_at(1 / 32, keys, 1, 1.7e9 + 10), None, rate=1 / 32)
    assert used == pytest.approx(len(keys) / 32, rel=0.4)
    curve = fleet.curves(CACHE, WINDOW_S)["search"]
    assert curve.max_hit_ratio == pytest.approx(0.5, abs=0.1)  # the first pass is kept
