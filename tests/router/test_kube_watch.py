"""The Kubernetes watch against kmock's KubernetesEmulator: pods by selector, an InferencePool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest

from cachefleet_e2e.k8s import EmulatorError, EmulatorHandle, run_emulator, write_kubeconfig
from cachefleet_router.discovery import EndpointPool, KubeDiscovery
from cachefleet_router.server import RouterConfig, RouterServer

pytestmark = pytest.mark.k8s_emulator

NS = "default"
PODS = f"/api/v1/namespaces/{NS}/pods"
POOLS = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"
#: bound on waiting for the watch to deliver an outcome (not a speed target)
WAIT_S = 15.0


@pytest.fixture
def emulator() -> Iterator[EmulatorHandle]:
    try:
        with run_emulator() as handle:
            handle.emulator.resources["v1/pods"] = kmock.ResourceInfo(
                kind="Pod",
                singular="pod",
                namespaced=True,
                verbs={"list", "watch", "get", "patch", "create", "delete"},
            )
            handle.emulator.resources["inference.networking.k8s.io/v1/inferencepools"] = (
                kmock.ResourceInfo(
                    kind="InferencePool",
                    singular="inferencepool",
                    namespaced=True,
                    verbs={"list", "watch", "get", "patch", "create", "delete"},
                )
            )
            yield handle
            # The emulator's watch handlers notice a client that left only when they next
            # write: one event on each watched resource ends them, so the emulator stops now.
            handle.create(PODS, pod("zz-flush", "10.255.0.1", app="flush"))
            handle.create(POOLS, {"metadata": {"name": "zz-flush", "namespace": NS}})
    except EmulatorError as exc:
        pytest.fail(str(exc))


def pod(name: str, ip: str, *, ready: bool = True, app: str = "vllm") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": app}},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def set_ready(emulator: EmulatorHandle, name: str, ready: bool) -> None:
    emulator.patch(
        f"{PODS}/{name}",
        {"status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}},
    )


async def until(predicate: Callable[[], Any], message: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not predicate():
        if loop.time() > deadline:
            pytest.fail(f"timed out: {message}")
        await asyncio.sleep(0.05)


def members(pool: EndpointPool) -> dict[str, str]:
    return {e.address: e.name for e in pool.endpoints()}


async def test_pods_by_selector_join_and_leave_with_watch_events(emulator: EmulatorHandle) -> None:
    emulator.create(PODS, pod("a", "10.1.0.1"))
    emulator.create(PODS, pod("b", "10.1.0.2", ready=False))
    emulator.create(PODS, pod("other", "10.1.0.9", app="redis"))
    pool = EndpointPool(require_metrics=False)
    async with httpx.AsyncClient(base_url=emulator.url) as client:
        discovery = KubeDiscovery(client, pool, NS, selector={"app": "vllm"}, target_ports=(8000,))
        task = asyncio.ensure_future(discovery.run())
        try:
            await until(lambda: members(pool) == {"10.1.0.1:8000": "a"}, "the listed ready pod")
            assert pool.synced
            await until(lambda: discovery.watches_opened >= 1, "the watch to open")

            set_ready(emulator, "b", True)
            await until(lambda: "10.1.0.2:8000" in members(pool), "b joins when ready")
            set_ready(emulator, "a", False)
            await until(lambda: "10.1.0.1:8000" not in members(pool), "a leaves when unready")
            emulator.delete(f"{PODS}/b")
            await until(lambda: members(pool) == {}, "b leaves when deleted")
            emulator.create(PODS, pod("c", "10.1.0.3"))
            await until(lambda: members(pool) == {"10.1.0.3:8000": "c"}, "a new pod joins")
            assert discovery.lists == 1  # all of it from one list and its watch
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_an_inference_pool_through_the_router_with_a_kubeconfig(
    emulator: EmulatorHandle, tmp_path: Path
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(str(kubeconfig), emulator.url, "router-token")
    emulator.create(
        POOLS,
        {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "llm", "namespace": NS},
            "spec": {
                "selector": {"matchLabels": {"app": "vllm"}},
                "targetPorts": [{"number": 8000}, {"number": 8001}],
                "endpointPickerRef": {"name": "llm-epp", "port": {"number": 9002}},
            },
        },
    )
    emulator.create(PODS, pod("a", "10.2.0.1"))
    config = RouterConfig(
        grpc_listen=("127.0.0.1", 0),
        metrics_listen=None,
        pool_name="llm",
        namespace=NS,
        kubeconfig=str(kubeconfig),
        scrape_interval_s=0,
    )
    router = RouterServer(config)
    await router.start()
    try:
        pool = router.pool
        await until(
            lambda: members(pool) == {"10.2.0.1:8000": "a", "10.2.0.1:8001": "a"},
            "every target port of the pool's pod",
        )
        assert "Bearer router-token" in emulator.emulator.authorizations
        emulator.patch(f"{POOLS}/llm", {"spec": {"targetPorts": [{"number": 9000}]}})
        await until(lambda: members(pool) == {"10.2.0.1:9000": "a"}, "the pool's new port")
        emulator.patch(f"{POOLS}/llm", {"spec": {"selector": {"matchLabels": {"app": "none"}}}})
        await until(lambda: members(pool) == {}, "a selector that matches nothing")
        emulator.patch(f"{POOLS}/llm", {"spec": {"selector": {"matchLabels": {"app": "vllm"}}}})
        await until(lambda: members(pool) == {"10.2.0.1:9000": "a"}, "the selector restored")
        emulator.delete(f"{POOLS}/llm")
        await until(lambda: members(pool) == {}, "the pool deleted: nothing to route to")
    finally:
        await router.stop(0)
