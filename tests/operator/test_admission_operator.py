"""spec.admission: from the CRD to the sidecar's flags, and Events when a pod sheds.

The Events part runs the reconciler against a real Redis, with heartbeats
written as a sidecar writes them.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aredis

from cachefleet_common.contract.messages import Heartbeat
from cachefleet_common.contract.ops import write_heartbeat
from cachefleet_operator.allocation import TenantMetrics
from cachefleet_operator.api import SpecError, parse_spec
from cachefleet_operator.injection import SidecarSettings, cache_info, sidecar_container
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.reconcile import Reconciler
from cachefleet_sidecar.config import parse_args

NS, NAME = "default", "chat"
CACHE = f"{NS}/{NAME}"


class Metrics:
    def factory(self, url: str, timeout_s: float) -> Metrics:
        return self

    async def fetch(
        self, cache: str, window: str, curve_window: str | None = None
    ) -> dict[str, TenantMetrics]:
        return {"gold": TenantMetrics(p95_s=0.1, hit_ratio=0.5, rps=10.0)}


def spec(redis_url: str = "redis://127.0.0.1:6379/0", **extra: Any) -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {"cachefleet.io/cache": NAME}},
        "model": {"name": "m", "version": "v1"},
        "capacity": {"l1BytesPerPod": 2**20, "l2Bytes": 2**24},
        "redis": {"url": redis_url},
        "prometheus": {"url": "http://127.0.0.1:9"},
        "tenants": [{"name": "gold", "priorityClass": "Guaranteed"}],
        **extra,
    }


def sidecar_env(raw_spec: dict[str, Any]) -> dict[str, str]:
    obj = {"metadata": {"namespace": NS, "name": NAME}, "spec": raw_spec}
    container = sidecar_container(cache_info(obj), SidecarSettings(image="img:1"))
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_admission_thresholds_reach_the_sidecar_flags() -> None:
    admission = {"maxWaiting": 4, "maxKvUsage": 0.9, "standardQueue": 16}
    env = sidecar_env(spec(admission=admission))
    assert env["CACHEFLEET_ADMISSION"] == "true"
    assert env["CACHEFLEET_ADMISSION_MAX_WAITING"] == "4"
    assert env["CACHEFLEET_ADMISSION_MAX_KV_USAGE"] == "0.9"
    args = [f"--{k[11:].lower().replace('_', '-')}={v}" for k, v in env.items() if "ADMISSION" in k]
    config = parse_args([a.replace("--admission=true", "--admission") for a in args])
    assert config.adapt.admission is not None
    assert (config.adapt.admission.max_waiting, config.adapt.admission.max_kv_usage) == (4, 0.9)
    assert config.adapt.admission.standard_queue == 16
    assert config.adapt.admission.standard_max_wait_s == 10.0  # the default, one place


def test_no_or_disabled_admission_sets_no_flag() -> None:
    assert not [k for k in sidecar_env(spec()) if "ADMISSION" in k]
    disabled = sidecar_env(spec(admission={"enabled": False, "maxWaiting": 3}))
    assert not [k for k in disabled if "ADMISSION" in k]


def test_bad_admission_spec_names_the_field() -> None:
    with pytest.raises(SpecError, match=r"admission\.maxKvUsage"):
        parse_spec(spec(admission={"maxKvUsage": 1.5}))
    assert parse_spec(spec(admission={})).admission is not None


def test_bad_admission_flag_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--admission", "--admission-max-kv-usage", "2"])
    assert "--admission-max-kv-usage" in capsys.readouterr().err


@pytest.mark.redis
async def test_events_when_a_pods_shedding_starts_and_stops(redis_url: str) -> None:
    reconciler = Reconciler(metrics_source=Metrics().factory, metrics=OperatorMetrics())
    client = aredis.Redis.from_url(redis_url)
    raw = spec(redis_url, admission={})
    try:
        await write_heartbeat(client, CACHE, Heartbeat(pod="p1", shedding=True))
        await write_heartbeat(client, CACHE, Heartbeat(pod="p2"))
        first = await reconciler.reconcile(NS, NAME, 1, raw, {})
        assert first.status["sidecars"]["shedding"] == ["p1"]
        started = [e for e in first.events if e.reason == "AdmissionShedding"]
        assert len(started) == 1
        assert "p1" in started[0].message
        assert started[0].type == "Warning"

        again = await reconciler.reconcile(NS, NAME, 1, raw, first.status)
        assert not [e for e in again.events if e.reason.startswith("Admission")]

        await write_heartbeat(client, CACHE, Heartbeat(pod="p1"))
        last = await reconciler.reconcile(NS, NAME, 1, raw, again.status)
        assert "shedding" not in last.status["sidecars"]
        stopped = [e for e in last.events if e.reason == "AdmissionRecovered"]
        assert [e.type for e in stopped] == ["Normal"]
        assert "p1" in stopped[0].message
    finally:
        await client.aclose()
