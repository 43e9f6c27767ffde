"""The chart's PrometheusRule and Grafana dashboard against promtool and the exported metrics.

``promtool test rules`` runs the rendered recording rules and alerts over
synthetic series shaped like the sidecar's, and checks that the recorded
hit ratio and p95 equal what :mod:`cachefleet_common.contract.promql`'s PromQL (the
operator's own queries) gives for one cache.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachefleet_common.contract.promql import (
    METRIC_ITL,
    METRIC_REQUEST_DURATION,
    METRIC_REQUESTS,
    METRIC_TTFT,
    promql_hit_ratio,
    promql_itl_p95_seconds,
    promql_p95_seconds,
    promql_ttft_p95_seconds,
)
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_sidecar.adapt import telemetry
from cachefleet_sidecar.cache.l2 import RedisL2
from cachefleet_sidecar.compose import build
from cachefleet_sidecar.config import SidecarConfig
from cachefleet_sidecar.observe import metrics
from cachefleet_sidecar.observe.metrics import TierUsage

from .test_chart import CHART, kinds, render

#: Timeout of one promtool run, seconds.
PROMTOOL_TIMEOUT_S = 30
CACHE = "inference/llama"


def rules_file(tmp_path: Path, monitoring: dict[str, Any] | None = None) -> Path:
    values = {"monitoring": {"prometheusOperator": True, **(monitoring or {})}}
    (rule,) = kinds(render(values)["docs"])["PrometheusRule"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    return path


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool not found: install the Debian prometheus package (make deps)"
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT_S, check=False
    )


@pytest.mark.prometheus
def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    result = promtool("check", "rules", str(rules_file(tmp_path)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 19 rules found" in result.stdout


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


@pytest.mark.prometheus
def test_rules_record_and_alert_on_sidecar_series(tmp_path: Path) -> None:
    t = {"cache": CACHE, "tenant": "acme", "namespace": "inference", "pod": "vllm-0"}
    reqs = METRIC_REQUESTS
    bucket = METRIC_REQUEST_DURATION + "_bucket"
    series = [
        # 40 hits and 40 misses a minute: hit ratio 0.5; 10 bypasses do not count
        _series(reqs, {**t, "tier": "l1", "result": "hit"}, "0+40x30"),
        _series(reqs, {**t, "tier": "upstream", "result": "miss"}, "0+40x30"),
        _series(reqs, {**t, "tier": "upstream", "result": "bypass"}, "0+10x30"),
        # every request between 1 s and 2.5 s: p95 = 1 + 1.5 * 0.95 = 2.425 s
        _series(bucket, {**t, "tier": "upstream", "le": "1.0"}, "0x30"),
        _series(bucket, {**t, "tier": "upstream", "le": "2.5"}, "0+30x30"),
        _series(bucket, {**t, "tier": "upstream", "le": "+Inf"}, "0+30x30"),
        _series("cachefleet_cross_tenant_hits_total", {"cache": CACHE}, "0 0 0 1 1 1 1 1 1 1"),
        _series("cachefleet_redis_errors_total", {"cache": CACHE}, "0x30"),
        # fleet samples: 100 sent a minute; none dropped, then (from 15m) 50 dropped a minute
        _series("cachefleet_fleet_samples_total", {**t, "outcome": "sent"}, "0+100x40"),
        _series("cachefleet_fleet_samples_total", {**t, "outcome": "dropped"}, "0x15 0+50x25"),
        _series(
            "cachefleet_gpu_telemetry_available", {"namespace": "inference", "pod": "p"}, "0x30"
        ),
        # first tokens between 0.25 s and 0.5 s (two models, added): p95 = 0.25 + 0.25 * 0.95
        *(
            _series(f"{METRIC_TTFT}_bucket", {**t, "model": m, "le": le}, v)
            for m in ("m1", "m2")
            for le, v in (("0.25", "0x30"), ("0.5", "0+30x30"), ("+Inf", "0+30x30"))
        ),
        # inter-token gaps between 10 ms and 50 ms: p95 = 0.01 + 0.04 * 0.95 = 0.048
        _series(f"{METRIC_ITL}_bucket", {**t, "model": "m1", "le": "0.01"}, "0x30"),
        _series(f"{METRIC_ITL}_bucket", {**t, "model": "m1", "le": "0.05"}, "0+30x30"),
        _series(f"{METRIC_ITL}_bucket", {**t, "model": "m1", "le": "+Inf"}, "0+30x30"),
        # the operator's targets for acme: TTFT 0.3 s (missed), ITL 0.05 s (met)
        _series(
            "cachefleet_operator_tenant_slo_target_seconds",
            {"cache": CACHE, "tenant": "acme", "objective": "ttft", "pod": "operator-0"},
            "0.3x30",
        ),
        _series(
            "cachefleet_operator_tenant_slo_target_seconds",
            {"cache": CACHE, "tenant": "acme", "objective": "itl", "pod": "operator-0"},
            "0.05x30",
        ),
    ]
    labels = f'{{cache="{CACHE}",tenant="acme"}}'
    tests: dict[str, Any] = {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [
            {
                "expr": f'cachefleet:tenant_hit_ratio:rate5m{{cache="{CACHE}"}}',
                "eval_time": "10m",
                "exp_samples": [
                    {"labels": f"cachefleet:tenant_hit_ratio:rate5m{labels}", "value": 0.5}
                ],
            },
            # the operator's own query gives the same number
            {
                "expr": promql_hit_ratio(CACHE, "5m"),
                "eval_time": "10m",
                "exp_samples": [{"labels": '{tenant="acme"}', "value": 0.5}],
            },
            {
                "expr": "cachefleet:tenant_latency_p95_seconds:rate5m",
                "eval_time": "10m",
                "exp_samples": [
                    {
                        "labels": f"cachefleet:tenant_latency_p95_seconds:rate5m{labels}",
                        "value": 2.425,
                    }
                ],
            },
            {
                "expr": promql_p95_seconds(CACHE, "5m"),
                "eval_time": "10m",
                "exp_samples": [{"labels": '{tenant="acme"}', "value": 2.425}],
            },
            {
                "expr": "cachefleet:tenant_ttft_p95_seconds:rate5m",
                "eval_time": "10m",
                "exp_samples": [
                    {
                        "labels": f"cachefleet:tenant_ttft_p95_seconds:rate5m{labels}",
                        "value": 0.4875,
                    }
                ],
            },
            {
                "expr": promql_ttft_p95_seconds(CACHE, "5m"),
                "eval_time": "10m",
                "exp_samples": [{"labels": '{tenant="acme"}', "value": 0.4875}],
            },
            {
                "expr": "cachefleet:tenant_itl_p95_seconds:rate5m",
                "eval_time": "10m",
                "exp_samples": [
                    {
                        "labels": f"cachefleet:tenant_itl_p95_seconds:rate5m{labels}",
                        "value": 0.048,
                    }
                ],
            },
            {
                "expr": promql_itl_p95_seconds(CACHE, "5m"),
                "eval_time": "10m",
                "exp_samples": [{"labels": '{tenant="acme"}', "value": 0.048}],
            },
        ],
        "alert_rule_test": [
            {
                "eval_time": "20m",
                "alertname": "CachefleetSLALatencyBreach",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "warning", "cache": CACHE, "tenant": "acme"},
                        "exp_annotations": {
                            "summary": f"p95 latency of tenant acme in {CACHE} is 2.425s",
                            "description": "Above the 1s SLA for 10m.",
                        },
                    }
                ],
            },
            {
                "eval_time": "20m",
                "alertname": "CachefleetSLATTFTBreach",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "warning", "cache": CACHE, "tenant": "acme"},
                        "exp_annotations": {
                            "summary": f"p95 time to first token of tenant acme in {CACHE} is "
                            "487.5ms, above its sla.ttftP95Seconds",
                        },
                    }
                ],
            },
            # 48 ms against its 50 ms target: met
            {"eval_time": "20m", "alertname": "CachefleetSLAITLBreach", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "CachefleetHitRatioDrop", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "CachefleetRedisErrors", "exp_alerts": []},
            # a third of the samples dropped from 15m: pending for 10m, firing after
            {"eval_time": "14m", "alertname": "CachefleetFleetSamplesDropped", "exp_alerts": []},
            {"eval_time": "24m", "alertname": "CachefleetFleetSamplesDropped", "exp_alerts": []},
            {
                "eval_time": "35m",
                "alertname": "CachefleetFleetSamplesDropped",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "warning", "cache": CACHE},
                        "exp_annotations": {
                            "summary": f"sidecars of {CACHE} drop 33.33% of their fleet "
                            "samples; the fleet-wide curves miss part of the fleet",
                            "description": "Redis faults, or more sampled accesses per "
                            "second than a batch holds (lower spec.fleetSampleRate).",
                        },
                    }
                ],
            },
            {
                "eval_time": "5m",
                "alertname": "CachefleetCrossTenantHits",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "critical", "cache": CACHE},
                        "exp_annotations": {
                            "summary": f"{CACHE}: a lookup found another tenant's entry "
                            "(refused, must never happen)"
                        },
                    }
                ],
            },
            {"eval_time": "5m", "alertname": "CachefleetGPUTelemetryMissing", "exp_alerts": []},
            {
                "eval_time": "20m",
                "alertname": "CachefleetGPUTelemetryMissing",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "info", "namespace": "inference", "pod": "p"},
                        "exp_annotations": {
                            "summary": "sidecar inference/p has no GPU telemetry (NVML unavailable)"
                        },
                    }
                ],
            },
        ],
    }
    rules = rules_file(tmp_path)
    test_file = tmp_path / "rules_test.yaml"
    test_file.write_text(
        yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [tests]})
    )
    result = promtool("test", "rules", str(test_file))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.prometheus
def test_pool_saturation_rules_on_model_server_series(tmp_path: Path) -> None:
    """What the HPA / KEDA read for autoscaling.signals poolSaturation, from vLLM and SGLang
    series as the model-server PodMonitor labels them (namespace, pod, cachefleet_io_cache)."""
    vllm = {"namespace": "inference", "cachefleet_io_cache": "llama"}
    sgl = {"namespace": "batch", "cachefleet_io_cache": "qwen"}
    series = [
        # llama: pod a waits 1 + 1 (two LoRA adapters: summed per pod), pod b 6 -> mean 4 = 1.0x
        _series("vllm:num_requests_waiting", {**vllm, "pod": "a", "model_name": "x"}, "1x30"),
        _series("vllm:num_requests_waiting", {**vllm, "pod": "a", "model_name": "y"}, "1x30"),
        _series("vllm:num_requests_waiting", {**vllm, "pod": "b", "model_name": "x"}, "6x30"),
        # KV usage 0.25 and 0.5 (b still exports the pre-v1 name too) -> mean 0.375 = 0.75x
        _series("vllm:kv_cache_usage_perc", {**vllm, "pod": "a"}, "0.25x30"),
        _series("vllm:kv_cache_usage_perc", {**vllm, "pod": "b"}, "0.5x30"),
        _series("vllm:gpu_cache_usage_perc", {**vllm, "pod": "b"}, "0.5x30"),
        # a model server without a cachefleet sidecar counts for no pool
        _series("vllm:num_requests_waiting", {"namespace": "inference", "pod": "z"}, "100x30"),
        # qwen on SGLang: queue 1 (0.25x), token usage 0.375 (0.75x): KV is the binding signal
        _series("sglang:num_queue_reqs", {**sgl, "pod": "q"}, "1x30"),
        _series("sglang:token_usage", {**sgl, "pod": "q"}, "0.375x30"),
    ]

    def sample(record: str, cache_ns: str, cache: str, value: float) -> dict[str, Any]:
        """The recorded series of one cache (its name dropped by the aggregation)."""
        expr = f'max by (cache_namespace, cache_name) ({record}{{cache_name="{cache}"}})'
        labels = f'{{cache_name="{cache}",cache_namespace="{cache_ns}"}}'
        return {
            "expr": expr,
            "eval_time": "5m",
            "exp_samples": [{"labels": labels, "value": value}],
        }

    tests: dict[str, Any] = {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [
            sample("cachefleet:pool_queue_depth:avg", "inference", "llama", 4.0),
            sample("cachefleet:pool_kv_usage:avg", "inference", "llama", 0.375),
            sample("cachefleet:pool_saturation", "inference", "llama", 1.0),
            sample("cachefleet:pool_saturation", "batch", "qwen", 0.75),
        ],
    }
    # saturation levels of 4 waiting requests and half the KV cache (exact in binary floats)
    rules = rules_file(tmp_path, {"modelServers": {"queueDepth": 4, "kvCacheUsage": 0.5}})
    test_file = tmp_path / "pool_test.yaml"
    test_file.write_text(
        yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [tests]})
    )
    result = promtool("test", "rules", str(test_file))
    assert result.returncode == 0, result.stdout + result.stderr


def exported_metric_names() -> set[str]:
    """Sample names the sidecar and operator expose, read from their real registries."""

    # a real L2 tier, never connected: its families are read from its counters and breakers
    l2 = RedisL2.from_url("redis://127.0.0.1:1", "ns/c")
    # with a Redis URL (never connected), so the fleet-sample shipper's counter is there too
    config = SidecarConfig.from_flat(
        cache="ns/c", admin_listen=None, redis_url="redis://127.0.0.1:1"
    )
    app = build(config, l2=l2)
    app.keying.enable_epochs()
    app.tracker.merge({"cache": 1})
    sidecar = app.metrics
    tm = sidecar.tenant("t")
    tm.request("l1", "hit", 0.001)
    tm.evicted("l1", 1)
    tm.saving("m").add(10, 5, 0.5, 0.01)
    tm.directive_ignored("no-cache")
    tm.answered("m", 0.3, 0.02)
    sidecar.usage_source = lambda: [TierUsage("t", "l1", 1, 2, "lru")]
    operator = OperatorMetrics()
    operator.reconcile_duration.labels(trigger="t", result="ok").observe(0.1)
    operator.reconcile_errors.labels(reason="r").inc()
    operator.set_slo_targets("ns/c", {("t", "ttft"): 0.3})
    names = {
        s.name
        for reg in (sidecar.registry, operator.registry)
        for fam in reg.collect()
        for s in fam.samples
    }
    # gauges that only appear with a GPU: names from their definitions
    source = Path(telemetry.__file__).read_text()
    names |= set(re.findall(r'"(cachefleet_gpu_[a-z_]+)"', source))
    # and those that only appear while unlisted tenants are admitted
    source = Path(metrics.__file__).read_text()
    names |= set(re.findall(r'"(cachefleet_guest[a-z_]*)"', source))
    return names


def test_dashboard_parses_and_uses_only_exported_or_recorded_metrics() -> None:
    dash = json.loads((CHART / "dashboards" / "cachefleet.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(dash["panels"]) >= 8
    (rule,) = kinds(render({"monitoring": {"prometheusOperator": True}})["docs"])["PrometheusRule"]
    recorded = {r["record"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r}
    known = exported_metric_names() | recorded
    used = {m for e in exprs for m in re.findall(r"\b(cachefleet[:_][a-z0-9_:]+)", e)}
    assert used - known == set()
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    needed_titles = ("hit ratio", "p99", "evictions", "quota", "gpu", "saved", "tokens saved")
    slo_titles = ("time to first token p95 by tenant", "inter-token latency p95 by tenant")
    for needed in (*needed_titles, *slo_titles, "fleet samples", "unlisted tenants' l2 pool"):
        assert needed in titles
    # the ConfigMap carries the same JSON
    (cm,) = [
        c for c in kinds(render()["docs"])["ConfigMap"] if "cachefleet.json" in c.get("data", {})
    ]
    assert json.loads(cm["data"]["cachefleet.json"]) == dash
