"""The whole cachefleet fleet on one machine, with no cluster.

:class:`LocalFleet` starts, on loopback:

* a real ``redis-server`` (L2 and the operator <-> sidecar contract);
* a stand-in OpenAI-compatible model server whose latency per tenant is set
  by the caller (:mod:`cachefleet_e2e.fake_upstream`);
* N ``cachefleet sidecar`` processes in front of it (real processes, uvloop);
* a real ``prometheus`` scraping every sidecar's admin port each second;
* kmock's Kubernetes API emulator with the real kopf operator against it,
  and an ``InferenceCache`` created there that points at Redis and
  Prometheus.

It is what ``cachefleet demo`` runs and what the e2e tests drive. Everything
it starts it stops, in reverse order, also when start-up fails half way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .fake_upstream import FakeUpstream
from .services import PrometheusServer, RedisServer, free_port

#: How long a sidecar process may take to answer /healthz, seconds.
SIDECAR_START_TIMEOUT_S = 20.0
#: How long the operator may take to publish the first quotas, seconds.
FIRST_QUOTAS_TIMEOUT_S = 30.0
NAMESPACE = "demo"
CACHE_NAME = "chat"


@dataclass(frozen=True)
class TenantPlan:
    """One tenant of the local fleet: its class, SLA and the upstream's latency for it."""

    name: str
    priority_class: str
    p95_latency_s: float
    min_hit_ratio: float = 0.0
    min_share: float = 0.0
    max_share: float = 1.0
    upstream_latency_s: float = 0.02


DEFAULT_TENANTS: tuple[TenantPlan, ...] = (
    TenantPlan("acme-support", "Guaranteed", 0.1, 0.5, 0.3, 0.8, upstream_latency_s=0.06),
    TenantPlan("search-assistant", "Standard", 0.15, 0.3, 0.1, 0.6, upstream_latency_s=0.04),
    TenantPlan("nightly-evals", "BestEffort", 1.0, 0.0, 0.0, 0.3, upstream_latency_s=0.02),
)


@dataclass
class SidecarProcess:
    pod: str
    port: int
    admin_port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


@dataclass
class LocalFleet:
    """Configuration of the fleet; :meth:`run` starts it as a context manager."""

    pods: int = 3
    tenants: tuple[TenantPlan, ...] = DEFAULT_TENANTS
    l1_bytes_per_pod: int = 1024 * 1024
    l2_bytes: int = 64 * 1024 * 1024
    rebalance_interval_s: int = 5
    metrics_window: str = "20s"
    model_version: str = "v1"
    default_policy: str = "lirs"
    with_operator: bool = True
    #: Extra flags for every sidecar process.
    sidecar_args: tuple[str, ...] = ()
    # filled in by run()
    redis: RedisServer | None = field(default=None, init=False)
    upstream: FakeUpstream | None = field(default=None, init=False)
    sidecars: list[SidecarProcess] = field(default_factory=list, init=False)
    prometheus: PrometheusServer | None = field(default=None, init=False)
    emulator: Any = field(default=None, init=False)
    workdir: Path | None = field(default=None, init=False)

    @property
    def cache(self) -> str:
        return f"{NAMESPACE}/{CACHE_NAME}"

    def inference_cache(self) -> dict[str, Any]:
        """The InferenceCache the fleet runs under (a plain Kubernetes object)."""
        assert self.redis is not None
        assert self.prometheus is not None
        return {
            "apiVersion": "cachefleet.io/v1alpha1",
            "kind": "InferenceCache",
            "metadata": {"name": CACHE_NAME, "namespace": NAMESPACE},
            "spec": {
                "selector": {"matchLabels": {"cachefleet.io/cache": CACHE_NAME}},
                "model": {"name": "demo-llm", "version": self.model_version},
                "capacity": {"l1BytesPerPod": self.l1_bytes_per_pod, "l2Bytes": self.l2_bytes},
                "redis": {"url": self.redis.url},
                "prometheus": {
                    "url": self.prometheus.url,
                    "window": self.metrics_window,
                    "timeoutSeconds": 2,
                },
                "defaultPolicy": self.default_policy,
                "rebalanceIntervalSeconds": self.rebalance_interval_s,
                "tenants": [
                    {
                        "name": t.name,
                        "priorityClass": t.priority_class,
                        "sla": {
                            "p95LatencySeconds": t.p95_latency_s,
                            "minHitRatio": t.min_hit_ratio,
                        },
                        "minShare": t.min_share,
                        "maxShare": t.max_share,
                    }
                    for t in self.tenants
                ],
            },
        }

    @property
    def ic_path(self) -> str:
        return f"/apis/cachefleet.io/v1alpha1/namespaces/{NAMESPACE}/inferencecaches/{CACHE_NAME}"

    def status(self) -> dict[str, Any]:
        """The InferenceCache's status as the operator wrote it ({} before it did)."""
        if self.emulator is None:
            return {}
        obj = self.emulator.get(self.ic_path)
        return dict((obj or {}).get("status") or {})

    def events(self) -> list[dict[str, Any]]:
        return [] if self.emulator is None else list(self.emulator.events())

    def _start_sidecar(self, index: int) -> SidecarProcess:
        assert self.redis is not None
        assert self.upstream is not None
        assert self.workdir is not None
        pod = f"pod-{index}"
        port, admin = free_port(), free_port()
        log_path = self.workdir / f"{pod}.log"
        env = {**os.environ, "CACHEFLEET_POD": pod}
        with log_path.open("wb") as sink:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "cachefleet_operator.cli",
                    "sidecar",
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--admin-listen",
                    f"127.0.0.1:{admin}",
                    "--upstream",
                    self.upstream.url,
                    "--redis-url",
                    self.redis.url,
                    "--cache",
                    self.cache,
                    "--l1-bytes",
                    str(self.l1_bytes_per_pod),
                    "--policy",
                    self.default_policy,
                    "--model-version",
                    self.model_version,
                    "--log-level",
                    "warning",
                    *self.sidecar_args,
                    # The load generator names tenants by header from loopback.
                    "--trusted-proxies",
                    "127.0.0.1/32",
                ],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return SidecarProcess(pod, port, admin, proc, log_path)

    def _wait_sidecars(self) -> None:
        deadline = time.monotonic() + SIDECAR_START_TIMEOUT_S
        pending = list(self.sidecars)
        while pending and time.monotonic() < deadline:
            for sc in list(pending):
                if sc.process.poll() is not None:
                    raise RuntimeError(
                        f"sidecar {sc.pod} exited: {sc.log_path.read_text()[-2000:]}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(sc.admin_url + "/healthz", timeout=0.5).status_code == 200:
                        pending.remove(sc)
            time.sleep(0.05)
        if pending:
            raise RuntimeError(f"sidecars not up within {SIDECAR_START_TIMEOUT_S}s: {pending}")

    def wait_for_quotas(self, timeout_s: float = FIRST_QUOTAS_TIMEOUT_S) -> dict[str, Any]:
        """Wait until every sidecar applied the operator's quotas; return the status."""
        deadline = time.monotonic() + timeout_s
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status = self.status()
            gen = status.get("quotaGeneration")
            if gen is not None and all(
                httpx.get(sc.admin_url + "/status", timeout=1).json()["quota_generation"] >= gen
                for sc in self.sidecars
            ):
                return status
            time.sleep(0.2)
        raise RuntimeError(f"quotas not applied within {timeout_s}s; status: {status}")

    @contextlib.contextmanager
    def run(self) -> Iterator[LocalFleet]:
        with contextlib.ExitStack() as stack:
            self.workdir = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="cachefleet-fleet-"))
            )
            self.redis = stack.enter_context(RedisServer())
            self.upstream = stack.enter_context(FakeUpstream())
            for t in self.tenants:
                self.upstream.latency_s[t.name] = t.upstream_latency_s
            stack.callback(self._stop_sidecars)
            self.sidecars = [self._start_sidecar(i) for i in range(self.pods)]
            self._wait_sidecars()
            targets = {
                "cachefleet-sidecars": [f"127.0.0.1:{sc.admin_port}" for sc in self.sidecars]
            }
            self.prometheus = stack.enter_context(PrometheusServer(targets, scrape_interval_s=1.0))
            if self.with_operator:
                from cachefleet_operator.reconcile import Reconciler

                from .k8s import run_emulator, run_operator

                self.emulator = stack.enter_context(run_emulator())
                stack.enter_context(
                    run_operator(self.emulator, [NAMESPACE], {"reconciler": Reconciler()})
                )
                self.emulator.create(
                    f"/apis/cachefleet.io/v1alpha1/namespaces/{NAMESPACE}/inferencecaches",
                    self.inference_cache(),
                )
            yield self

    def _stop_sidecars(self) -> None:
        for sc in self.sidecars:
            if sc.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    sc.process.send_signal(signal.SIGTERM)
        for sc in self.sidecars:
            try:
                sc.process.wait(5)
            except subprocess.TimeoutExpired:
                sc.process.kill()
                sc.process.wait(5)

    def sidecar_status(self) -> Mapping[str, Any]:
        return {
            sc.pod: httpx.get(sc.admin_url + "/status", timeout=2).json() for sc in self.sidecars
        }
