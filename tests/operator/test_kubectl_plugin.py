"""``kubectl cachefleet`` end to end against kmock's API emulator served over HTTP.

The plugin reads a kubeconfig like any kubectl plugin and talks to the
emulator through the official ``kubernetes`` client; the operator's part is
played by the test (it writes the status the operator would), so each test
decides exactly what the cluster says.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest

from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.messages import EpochAck, Heartbeat
from cachefleet_common.contract.names import Policy, cache_ref
from cachefleet_common.contract.ops import write_ack, write_heartbeat
from cachefleet_e2e.k8s import write_kubeconfig
from cachefleet_operator.api import InvalidationPhase
from cachefleet_operator.kubectl_plugin import cli
from cachefleet_operator.kubectl_plugin.cluster import Cluster, connect

from .conftest import IC_PATH, NAMESPACE, EmulatorHandle

pytestmark = pytest.mark.k8s_emulator

CI_PATH = f"/apis/cachefleet.io/v1alpha1/namespaces/{NAMESPACE}/cacheinvalidations"
MI = 1024 * 1024


def _spec(redis: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {"app": "llm"}},
        "model": {"name": "llama-3-8b", "version": "v7"},
        "capacity": {"l1BytesPerPod": 1024 * MI, "l2Bytes": 8 * 1024 * MI},
        "redis": redis or {"url": "redis://127.0.0.1:1/0"},
        "prometheus": {"url": "http://127.0.0.1:9"},
        "tenants": [
            {"name": "search", "priorityClass": "Guaranteed", "minShare": 0.5},
            {"name": "sweep", "priorityClass": "BestEffort"},
        ],
    }


STATUS: dict[str, Any] = {
    "quotaGeneration": 7,
    "lastRebalanceTime": "2026-12-01T11:59:15Z",
    "tenantCount": 2,
    "slaAttainment": "1/2",
    "tenants": [
        {
            "name": "search",
            "priorityClass": "Guaranteed",
            "share": 0.625,
            "weight": 3.0,
            "l1Bytes": 640 * MI,
            "l2Bytes": 5 * 1024 * MI,
            "reason": "floor 0.5",
            "observed": {"hitRatio": 0.7312, "p95Seconds": 0.084, "rps": 41.5},
            "slaMet": True,
        },
        {
            "name": "sweep",
            "priorityClass": "BestEffort",
            "share": 0.375,
            "weight": 0.25,
            "l1Bytes": 384 * MI,
            "l2Bytes": 3 * 1024 * MI,
            "reason": "what is left",
            "observed": {"hitRatio": 0.04, "p95Seconds": 1.9, "rps": 3.0},
            "slaMet": False,
        },
    ],
    "sidecars": {"seen": 3, "inSync": 2, "epochsInSync": 3},
    "epochs": {"cache": 1, "tenant:search": 4},
    "conditions": [
        {"type": "Ready", "status": "True", "reason": "QuotasPublished", "message": "published"}
    ],
}


@pytest.fixture
def kubeconfig(emulator: EmulatorHandle, tmp_path: Path) -> str:
    path = str(tmp_path / "kubeconfig")
    write_kubeconfig(path, emulator.url, "plugin-token", namespace=NAMESPACE)
    return path


def _seed(emulator: EmulatorHandle, name: str = "chat", **spec_args: Any) -> None:
    emulator.create(
        IC_PATH,
        {
            "apiVersion": "cachefleet.io/v1alpha1",
            "kind": "InferenceCache",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": _spec(**spec_args),
        },
    )
    emulator.patch(f"{IC_PATH}/{name}/status", {"status": STATUS})


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _cells(line: str) -> list[str]:
    import re

    return re.split(r" {3,}", line.strip())


def test_status_of_a_seeded_cache(emulator: EmulatorHandle, kubeconfig: str) -> None:
    _seed(emulator)
    code, out, err = _run("status", "chat", "--kubeconfig", kubeconfig)
    assert (code, err) == (0, "")
    assert "InferenceCache default/chat  model llama-3-8b v7" in out
    assert "3 live, 2 in sync with the quotas, 3 with the epochs" in out
    assert "lagging:      1 behind quota generation 7; none behind the epochs" in out
    rows = {_cells(line)[0]: _cells(line) for line in out.splitlines() if line.startswith("  ")}
    assert rows["search"] == ["search", "Guaranteed", "62.5%", "640Mi", "5Gi", "0.73", "met"]
    assert rows["sweep"] == ["sweep", "BestEffort", "37.5%", "384Mi", "3Gi", "0.04", "MISSED"]
    # flags before the command work too (kubectl passes them on as written)
    code, listed, _ = _run("--kubeconfig", kubeconfig, "status", "-o", "json")
    assert code == 0
    assert '"name": "chat"' in listed


def test_status_of_missing_objects_and_namespaces(
    emulator: EmulatorHandle, kubeconfig: str
) -> None:
    code, out, err = _run("status", "nope", "--kubeconfig", kubeconfig)
    assert code == cli.EXIT_ERROR
    assert out == ""
    assert err == "error: InferenceCache \"nope\" not found in namespace 'default'\n"
    code, out, err = _run("status", "--kubeconfig", kubeconfig, "-n", "elsewhere")
    assert (code, out) == (0, "")
    assert "No InferenceCaches found in namespace 'elsewhere'" in err


def test_status_of_every_namespace(emulator: EmulatorHandle, kubeconfig: str) -> None:
    _seed(emulator)
    emulator.create(
        "/apis/cachefleet.io/v1alpha1/namespaces/batch/inferencecaches",
        {
            "apiVersion": "cachefleet.io/v1alpha1",
            "kind": "InferenceCache",
            "metadata": {"name": "embed", "namespace": "batch"},
            "spec": _spec(),
        },
    )
    code, out, _ = _run("status", "-A", "--kubeconfig", kubeconfig)
    assert code == 0
    headers = [line for line in out.splitlines() if line.startswith("InferenceCache ")]
    assert headers == [
        "InferenceCache batch/embed  model llama-3-8b v7",
        "InferenceCache default/chat  model llama-3-8b v7",
    ]
    code, out, _ = _run("status", "-n", "batch", "--kubeconfig", kubeconfig)
    assert "none yet (is the operator running" in out
    assert "default/chat" not in out
    # without -n: the kubeconfig context's namespace
    other = str(Path(kubeconfig).with_name("batch.kubeconfig"))
    write_kubeconfig(other, emulator.url, "plugin-token", namespace="batch")
    code, out, _ = _run("status", "--kubeconfig", other)
    assert out.startswith("InferenceCache batch/embed ")
    assert "default/chat" not in out


def test_crds_not_installed(emulator: EmulatorHandle, kubeconfig: str) -> None:
    del emulator.emulator.resources["cachefleet.io/v1alpha1/inferencecaches"]
    code, _, err = _run("status", "chat", "--kubeconfig", kubeconfig)
    assert code == cli.EXIT_ERROR
    assert "the cachefleet CRDs are not installed" in err


def test_no_cluster_reachable(tmp_path: Path) -> None:
    sock = socket.socket()  # a port nothing listens on: bind, then close
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    path = str(tmp_path / "kubeconfig")
    write_kubeconfig(path, f"http://127.0.0.1:{port}", "t")
    code, _, err = _run("status", "--kubeconfig", path)
    assert code == cli.EXIT_ERROR
    assert f"cannot reach the Kubernetes API at http://127.0.0.1:{port}" in err
    code, _, err = _run("status", "--kubeconfig", str(tmp_path / "absent"))
    assert (code, err) == (
        cli.EXIT_ERROR,
        f"error: --kubeconfig {tmp_path / 'absent'}: no such file\n",
    )
    code, _, err = _run("status", "--kubeconfig", path, "--context", "prod")
    assert code == cli.EXIT_ERROR
    assert "--context prod: not in" in err
    assert "(contexts: emulator)" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("invalidate", "chat", "--scope", "key", "--key", "abc"),
            "error: --key: 'abc' is not 64 hex digits",
        ),
        (("invalidate", "chat", "--scope", "tenant"), "error: --scope tenant needs --tenant\n"),
        (("invalidate", "chat", "--scope", "tenant", "--tenant", "a/b"), "error: --tenant: "),
        (
            ("invalidate", "chat", "--scope", "cache", "--model", "m"),
            "error: --model goes with --scope model",
        ),
        (("invalidate", "chat", "--scope", "cache", "--timeout", "2d"), "error: --timeout "),
        (("top", "chat", "--redis-url", "garbage://"), "error: --redis-url: not a Redis URL"),
        (("top", "chat", "--redis-url", "redis://"), "error: --redis-url: no host"),
    ],
)
def test_bad_flags_are_usage_errors_even_with_the_api_down(
    tmp_path: Path, argv: tuple[str, ...], message: str
) -> None:
    """Issue 34 (8): the flags were checked only after the first API call, so with the API
    down a usage error read "cannot reach the API" (exit 1). They are checked first."""
    sock = socket.socket()  # a port nothing listens on: bind, then close
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    path = str(tmp_path / "kubeconfig")
    write_kubeconfig(path, f"http://127.0.0.1:{port}", "t")
    code, out, err = _run(*argv, "--kubeconfig", path)
    assert (code, out) == (cli.EXIT_USAGE, ""), err
    assert err.startswith(message), err
    # good flags go on to the API (here: unreachable); --scope model takes the cache's model
    code, _, err = _run("invalidate", "chat", "--scope", "model", "--kubeconfig", path)
    assert code == cli.EXIT_ERROR
    assert "cannot reach the Kubernetes API" in err


def _operator_stand_in(
    emulator: EmulatorHandle, outcome: dict[str, Any]
) -> tuple[threading.Thread, dict[str, Any]]:
    """A thread that plays the operator: waits for a CacheInvalidation, then writes statuses."""
    seen: dict[str, Any] = {}

    def play() -> None:
        with contextlib.suppress(httpx.HTTPError), httpx.Client(base_url=emulator.url) as http:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                items = http.get(CI_PATH).json().get("items") or []
                if items:
                    break
                time.sleep(0.05)
            else:
                return
            obj = items[0]
            seen["object"] = obj
            name = obj["metadata"]["name"]
            merge = {"Content-Type": "application/merge-patch+json"}
            running = {"phase": "Running", "epoch": 5, "message": "advancing tenant:search"}
            http.patch(f"{CI_PATH}/{name}/status", json={"status": running}, headers=merge)
            # the outcome only after the plugin has read the object again (it saw Running)
            fetch = (kmock.action.FETCH, "cacheinvalidations")
            before = emulator.emulator.seen.count(fetch)
            while emulator.emulator.seen.count(fetch) == before and time.monotonic() < deadline:
                time.sleep(0.05)
            http.patch(f"{CI_PATH}/{name}/status", json={"status": outcome}, headers=merge)

    thread = threading.Thread(target=play, daemon=True)
    thread.start()
    return thread, seen


def test_invalidate_wait_until_completed(emulator: EmulatorHandle, kubeconfig: str) -> None:
    _seed(emulator)
    done = {
        "phase": "Completed",
        "epoch": 5,
        "acks": 3,
        "expectedAcks": 3,
        "propagationSeconds": 0.0123,
        "laggingPods": [],
        "message": "tenant:search advanced to epoch 5; 3 sidecar(s) acknowledged in 12.3 ms",
    }
    thread, seen = _operator_stand_in(emulator, done)
    code, out, err = _run(
        "invalidate", "chat", "--scope", "tenant", "--tenant", "search", "--wait",
        "--timeout", "30s", "--reason", "kb refresh", "--kubeconfig", kubeconfig,
    )  # fmt: skip
    thread.join(5)
    assert (code, err) == (0, "")
    spec = seen["object"]["spec"]
    assert spec == {
        "cacheRef": {"name": "chat"},
        "scope": {"type": "Tenant", "tenant": "search"},
        "timeoutSeconds": 30,
        "reason": "kb refresh",
    }
    name = seen["object"]["metadata"]["name"]
    assert name.startswith("chat-")
    lines = out.splitlines()
    assert lines[0].startswith(f"cacheinvalidation.cachefleet.io/{name} created (tenant:search")
    assert f"{name}: Running, epoch 5: advancing tenant:search" in lines
    assert f"{name}: Completed, epoch 5, 3/3 sidecars acknowledged: {done['message']}" in lines
    assert lines[-1] == f"invalidation {name} completed"


def test_invalidate_wait_until_failed_names_lagging_pods(
    emulator: EmulatorHandle, kubeconfig: str
) -> None:
    _seed(emulator)
    failed = {
        "phase": "Failed",
        "epoch": 2,
        "acks": 1,
        "expectedAcks": 3,
        "laggingPods": ["llm-1", "llm-2"],
        "message": "model:llama-3-8b advanced to epoch 2, but 2 of 3 live sidecar(s) did not "
        "acknowledge within 60s: llm-1, llm-2",
    }
    thread, seen = _operator_stand_in(emulator, failed)
    code, out, err = _run(
        "invalidate", "chat", "--scope", "model", "--wait", "--kubeconfig", kubeconfig
    )
    thread.join(5)
    assert code == cli.EXIT_INVALIDATION_FAILED
    assert seen["object"]["spec"]["scope"] == {"type": "Model", "model": "llama-3-8b"}
    assert "Failed, epoch 2, 1/3 sidecars acknowledged" in out
    assert err.startswith(f"error: invalidation {seen['object']['metadata']['name']} failed: ")
    assert err.rstrip().endswith("(lagging pods: llm-1, llm-2)")


def test_invalidate_refuses_before_creating_anything(
    emulator: EmulatorHandle, kubeconfig: str
) -> None:
    code, _, err = _run("invalidate", "nope", "--scope", "cache", "--kubeconfig", kubeconfig)
    assert code == cli.EXIT_ERROR
    assert 'InferenceCache "nope" not found' in err
    _seed(emulator)
    code, _, err = _run("invalidate", "chat", "--scope", "tenant", "--kubeconfig", kubeconfig)
    assert (code, err) == (cli.EXIT_USAGE, "error: --scope tenant needs --tenant\n")
    code, _, err = _run(
        "invalidate",
        "chat",
        "--scope",
        "tenant",
        "--tenant",
        "bad name!",
        "--kubeconfig",
        kubeconfig,
    )
    assert code == cli.EXIT_USAGE
    assert err.startswith("error: --tenant: ")
    assert (emulator.get(CI_PATH) or {}).get("items") == []


def test_invalidate_without_wait_and_the_wait_bound(
    emulator: EmulatorHandle, kubeconfig: str
) -> None:
    _seed(emulator)
    code, out, _ = _run(
        "invalidate", "chat", "--scope", "cache", "-o", "name", "--kubeconfig", kubeconfig
    )
    assert code == 0
    name = out.strip().removeprefix("cacheinvalidation.cachefleet.io/")
    assert emulator.get(f"{CI_PATH}/{name}") is not None
    # nobody writes a status (no operator): the wait ends at its bound, not before
    cluster = Cluster(connect(kubeconfig, None, None))
    progress = io.StringIO()
    code, view = cli.wait_for_outcome(
        lambda: cluster.get("cacheinvalidations", NAMESPACE, name), 0.3, progress, poll_s=0.05
    )
    assert code == cli.EXIT_TIMEOUT
    assert view.phase == InvalidationPhase.PENDING.value
    assert progress.getvalue() == f"{name}: Pending\n"  # one line: nothing changed


DIGEST = "5e1f" + "0123456789abcdef" * 3 + "a1b2c3d4e5f6"


def test_invalidate_one_key_wait_until_completed(emulator: EmulatorHandle, kubeconfig: str) -> None:
    _seed(emulator)
    done = {
        "phase": "Completed",
        "epoch": 3,
        "acks": 3,
        "expectedAcks": 3,
        "message": f"purge (key {DIGEST}) advanced to epoch 3; 3 sidecar(s) acknowledged",
    }
    thread, seen = _operator_stand_in(emulator, done)
    code, out, err = _run(
        "invalidate", "chat", "--scope", "key", "--key", DIGEST.upper(), "--tenant", "search",
        "--wait", "--timeout", "30s", "--kubeconfig", kubeconfig,
    )  # fmt: skip
    thread.join(5)
    assert (code, err) == (0, "")
    # exactly what the CRD takes: the digest as the X-Cache-Key header spells it
    assert seen["object"]["spec"] == {
        "cacheRef": {"name": "chat"},
        "scope": {"type": "Key", "tenant": "search", "key": DIGEST},
        "timeoutSeconds": 30,
    }
    name = seen["object"]["metadata"]["name"]
    lines = out.splitlines()
    assert lines[0] == (
        f"cacheinvalidation.cachefleet.io/{name} created (purge of key {DIGEST} in tenant "
        f"search of {NAMESPACE}/chat, acknowledgement timeout 30s)"
    )
    assert f"{name}: Completed, epoch 3, 3/3 sidecars acknowledged: {done['message']}" in lines
    assert lines[-1] == f"invalidation {name} completed"
    code, out, _ = _run("status", "chat", "--kubeconfig", kubeconfig)
    assert code == 0
    assert (
        f"invalidation: {name} Completed (purge of key {DIGEST} in tenant search, epoch 3, "
        "3/3 acks)" in out
    )


def test_invalidate_one_namespace_and_status_shows_it(
    emulator: EmulatorHandle, kubeconfig: str
) -> None:
    _seed(emulator)
    failed = {
        "phase": "Failed",
        "epoch": 1,
        "acks": 2,
        "expectedAcks": 3,
        "laggingPods": ["llm-2"],
        "message": "namespace:search/kb-billing advanced to epoch 1, but 1 of 3 did not ...",
    }
    thread, seen = _operator_stand_in(emulator, failed)
    # -n is kubectl's (the cache's Kubernetes namespace); the cache namespace has its own flag
    code, out, err = _run(
        "invalidate", "chat", "-n", NAMESPACE, "--scope", "namespace", "--tenant", "search",
        "--namespace-value", "kb-billing", "--wait", "--kubeconfig", kubeconfig,
    )  # fmt: skip
    thread.join(5)
    assert code == cli.EXIT_INVALIDATION_FAILED
    assert seen["object"]["spec"]["scope"] == {
        "type": "Namespace",
        "tenant": "search",
        "namespace": "kb-billing",
    }
    name = seen["object"]["metadata"]["name"]
    assert out.startswith(
        f"cacheinvalidation.cachefleet.io/{name} created (namespace:search/kb-billing of "
    )
    assert err.rstrip().endswith("(lagging pods: llm-2)")
    code, out, _ = _run("status", "chat", "--kubeconfig", kubeconfig)
    assert code == 0
    assert (
        f"invalidation: {name} Failed (namespace:search/kb-billing, epoch 1, 2/3 acks); "
        "lagging pods: llm-2" in out
    )


def test_invalidate_new_scopes_refuse_before_creating_anything(
    emulator: EmulatorHandle, kubeconfig: str
) -> None:
    _seed(emulator)
    refusals = [
        (["--scope", "key"], "error: --scope key needs --key (the X-Cache-Key response header"),
        (["--scope", "key", "--key", "abc123"], "error: --key: 'abc123' is not 64 hex digits"),
        (
            ["--scope", "namespace", "--tenant", "search"],
            "error: --scope namespace needs --namespace-value",
        ),
        (
            ["--scope", "namespace", "--tenant", "search", "--namespace-value", "kb billing"],
            "error: --namespace-value: 'kb billing': 1-63 of [A-Za-z0-9._-]",
        ),
        (
            ["--scope", "cache", "--namespace-value", "kb"],
            "error: --namespace-value goes with --scope namespace, not --scope cache",
        ),
        (["--scope", "tenant", "--key", DIGEST], "error: --key goes with --scope key"),
    ]
    for flags, message in refusals:
        code, out, err = _run("invalidate", "chat", *flags, "--kubeconfig", kubeconfig)
        assert (code, out) == (cli.EXIT_USAGE, ""), flags
        assert err.startswith(message), (flags, err)
    assert (emulator.get(CI_PATH) or {}).get("items") == []


def _pods(emulator: EmulatorHandle, *pods: tuple[str, str]) -> None:
    """Serve v1/pods and create ``(name, app label)`` pods, running and ready."""
    emulator.emulator.resources["v1/pods"] = kmock.ResourceInfo(
        kind="Pod", singular="pod", namespaced=True, verbs={"list", "get", "create"}
    )
    pod_path = f"/api/v1/namespaces/{NAMESPACE}/pods"
    for name, app in pods:
        emulator.create(
            pod_path,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": app}},
                "spec": {"containers": [{"name": "vllm", "image": "v"}], "nodeName": "node-a"},
                "status": {
                    "phase": "Running",
                    "containerStatuses": [
                        {"name": "vllm", "ready": True, "restartCount": 1, "image": "v"}
                    ],
                },
            },
        )


@pytest.mark.redis
def test_top_joins_pods_and_heartbeats(
    emulator: EmulatorHandle, kubeconfig: str, redis_url: str
) -> None:
    # (the emulator ignores labelSelector: only the cache's pods exist here)
    _pods(emulator, ("llm-0", "llm"), ("llm-1", "llm"))
    # spec.redis names a Secret, as it does when Redis has a password
    emulator.emulator.resources["v1/secrets"] = kmock.ResourceInfo(
        kind="Secret", singular="secret", namespaced=True, verbs={"get", "create"}
    )
    emulator.create(
        f"/api/v1/namespaces/{NAMESPACE}/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "chat-redis", "namespace": NAMESPACE},
            "data": {"url": base64.b64encode(redis_url.encode()).decode()},
        },
    )
    _seed(emulator, redis={"secretRef": {"name": "chat-redis"}})
    cache = cache_ref(NAMESPACE, "chat")

    async def heartbeats() -> None:
        client = redis_from_url(redis_url)
        try:
            seen = (("llm-0", 7, {"cache": 1, "tenant:search": 4}), ("llm-9", 6, {"cache": 1}))
            for pod, generation, epochs in seen:
                await write_heartbeat(
                    client,
                    cache,
                    Heartbeat(
                        pod=pod,
                        quota_generation=generation,
                        policy_by_tenant={"search": Policy.SITS},
                    ),
                    ttl_s=300,  # live for the whole test, however slow the machine
                )
                await write_ack(client, cache, EpochAck(pod=pod, epochs=epochs))
        finally:
            await client.aclose()

    asyncio.run(heartbeats())
    code, out, err = _run("top", "chat", "--kubeconfig", kubeconfig)
    assert (code, err) == (0, "")
    rows = {_cells(line)[0]: _cells(line) for line in out.splitlines()[1:]}
    assert set(rows) == {"llm-0", "llm-1", "llm-9"}
    assert rows["llm-0"][1:3] == ["1/1", "Running"]
    assert rows["llm-0"][4:] == ["gen 7 in sync", "acked", "ok", "search=sits"]
    assert rows["llm-1"][3:7] == ["-", "no heartbeat", "-", "-"]
    assert rows["llm-9"][2] == "not matched"
    assert rows["llm-9"][4:6] == ["gen 6 LAGGING (want 7)", "LAGGING"]


def test_top_says_when_redis_is_out_of_reach(emulator: EmulatorHandle, kubeconfig: str) -> None:
    _seed(emulator)  # spec.redis points at a port nothing listens on
    _pods(emulator, ("llm-0", "llm"))
    code, out, err = _run("top", "--kubeconfig", kubeconfig)
    assert code == 0
    assert _cells(out.splitlines()[1]) == ["llm-0", "1/1", "Running", "-", "?", "?", "?", "-"]
    assert "warning: sidecar columns unknown: cannot read the sidecars' heartbeats" in err
    assert "redis://127.0.0.1:1/0" in err
    assert "--redis-url" in err


@pytest.fixture
def plugin_on_path(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``kubectl`` finding ``kubectl-cachefleet`` on PATH, as after installing the package."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (apt-get install kubectl)")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "kubectl-cachefleet"
    shim.write_text(
        f'#!/bin/sh\nexec {sys.executable} -m cachefleet_operator.kubectl_plugin "$@"\n'
    )
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [kubectl, *argv], env=env, capture_output=True, text=True, timeout=60, check=False
        )

    return run


def test_kubectl_runs_the_plugin(
    emulator: EmulatorHandle,
    kubeconfig: str,
    plugin_on_path: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    _seed(emulator)
    done = plugin_on_path("cachefleet", "status", "chat", "--kubeconfig", kubeconfig)
    assert done.returncode == 0, done.stderr
    assert "InferenceCache default/chat" in done.stdout
    missing = plugin_on_path("cachefleet", "status", "gone", "--kubeconfig", kubeconfig)
    assert missing.returncode == cli.EXIT_ERROR
    assert 'InferenceCache "gone" not found' in missing.stderr
