"""Fixtures of the `vllm` tier: real vLLM servers serving the tiny model, and sidecars in front.

Every test under tests/vllm/ is marked ``vllm`` (and given a generous timeout: the
first one pays for starting the servers). The tier needs vLLM's own venv
(``make vllm-env``, which ``make test`` runs); without it every test here is skipped
with that reason, and the rest of the suite runs as before.

The servers are shared by the whole tier (package scope: they start at its first test
and stop after its last, not at the session's end): :data:`POOL_SIZE` of them (1.2 GB and
~14 s each on an idle machine; they start side by side; idle, they use 1-2 % of a
core). Each has prefix caching, ZMQ KV events on its own port, and ``--max-num-seqs``
:data:`MAX_NUM_SEQS` so a test can fill its batch and make requests wait
(``vllm:num_requests_waiting``) with a handful of requests. A test that pauses a server
(``POST /pause``) must resume it; the ``vllm`` fixture checks that the server it hands
out is healthy and not paused.

The tier's timings (model build, server start) are printed in pytest's summary.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefleet_e2e.vllm_server import (
    SERVED_MODEL,
    TinyModel,
    VllmServer,
    VllmUnavailable,
    start_all,
    tiny_model,
    vllm_python,
)
from cachefleet_sidecar.app import SidecarServer
from cachefleet_sidecar.config import SidecarConfig
from tests.integration.conftest import RunningSidecar

HERE = Path(__file__).resolve().parent
#: Servers the tier shares (the router's acceptance tests need three).
POOL_SIZE = 3
#: Requests one server runs at once; more wait in its queue.
MAX_NUM_SEQS = 4
#: Per-test bound of this tier, seconds: the first test starts the servers.
TIER_TIMEOUT_S = 900
#: Bound on waiting for a server's metrics to show something, seconds.
METRICS_BOUND_S = 60.0

#: What the tier measured, printed at the end of the run.
TIMINGS: dict[str, str] = {}

VllmSidecarFactory = Callable[..., Awaitable[RunningSidecar]]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.timeout(TIER_TIMEOUT_S))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMINGS:
        terminalreporter.write_sep("-", "vllm tier")
        for what, value in TIMINGS.items():
            terminalreporter.write_line(f"{what}: {value}")


@pytest.fixture(scope="session")
def vllm_interpreter() -> Path:
    """vLLM's python, or a skip saying how to get it."""
    try:
        return vllm_python()
    except VllmUnavailable as exc:
        pytest.skip(f"the vllm tier needs vLLM's venv: {exc}")


@pytest.fixture(scope="session")
def tiny(vllm_interpreter: Path) -> TinyModel:
    """The tiny Llama, built once (or reused from .cache/tinymodel by content hash)."""
    model = tiny_model(vllm_interpreter)
    TIMINGS["tiny model"] = (
        f"{'built' if model.built else 'reused'} in {model.seconds:.1f} s, "
        f"digest {model.digest[:12]}"
    )
    return model


@pytest.fixture(scope="package")
def vllm_pool(tiny: TinyModel, vllm_interpreter: Path) -> Iterator[list[VllmServer]]:
    """:data:`POOL_SIZE` real vLLM servers, started side by side, stopped with SIGTERM once
    this package's tests are done (not at the session's end: they hold 1.2 GB each)."""
    servers = [
        VllmServer(
            tiny.path,
            python=vllm_interpreter,
            name=f"vllm-{i}",
            extra_args=["--max-num-seqs", str(MAX_NUM_SEQS)],
        )
        for i in range(POOL_SIZE)
    ]
    started = time.monotonic()
    start_all(servers)
    TIMINGS["servers"] = (
        f"{POOL_SIZE} healthy in {time.monotonic() - started:.1f} s "
        f"(each {', '.join(f'{s.start_s:.1f}' for s in servers if s.start_s is not None)} s)"
    )
    yield servers
    stopped = time.monotonic()
    for server in servers:
        server.stop()
    TIMINGS["stop"] = f"{time.monotonic() - stopped:.1f} s"


async def healthy(server: VllmServer) -> VllmServer:
    """The server, after checking it runs, answers /health and is not paused."""
    assert server.running, f"{server.name} exited: {server.log_tail()}"
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        if (await http.get("/is_paused")).json().get("is_paused"):
            await http.post("/resume")  # a test that paused it failed before resuming
        assert (await http.get("/health")).status_code == 200
    return server


@pytest.fixture
async def vllm(vllm_pool: list[VllmServer]) -> VllmServer:
    """The pool's first server, checked."""
    return await healthy(vllm_pool[0])


@pytest.fixture
async def vllm_pair(vllm_pool: list[VllmServer]) -> list[VllmServer]:
    """The pool's first two servers, checked (two pods, each with its own model server)."""
    return [await healthy(server) for server in vllm_pool[:2]]


# ------------------------------------------------------------------ reading vLLM


def sample_sum(text: str, name: str, **labels: str) -> float:
    """Sum of one metric's samples (over the label sets matching ``labels``); 0 if none."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += float(sample.value)
    return total


async def vllm_metric(server: VllmServer, name: str, **labels: str) -> float:
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(f"{server.url}/metrics")).text
    return sample_sum(text, name, **labels)


async def finished(server: VllmServer) -> float:
    """Requests the server has finished (``vllm:request_success_total``, every reason)."""
    return await vllm_metric(server, "vllm:request_success_total")


async def until_finished(server: VllmServer, count: float) -> None:
    """Wait (bounded) until the server counts ``count`` finished requests: its counter
    moves when the engine's step ends, a moment after the answer left."""
    deadline = time.monotonic() + METRICS_BOUND_S
    while (seen := await finished(server)) < count:
        assert time.monotonic() < deadline, f"{server.name} finished {seen} of {count}"
        await asyncio.sleep(0.05)


def chat_body(content: str, **fields: Any) -> dict[str, Any]:
    """A deterministic chat request for the tiny model: 8 tokens, EOS ignored (the random
    model may end at once or emit specials; tests assert on ``usage``, not on text)."""
    return {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 8,
        "ignore_eos": True,
        **fields,
    }


async def ask(
    sc: RunningSidecar, content: str, tenant: str = "acme", **fields: Any
) -> httpx.Response:
    """One chat request through the sidecar (see :func:`chat_body`)."""
    headers = {"X-Tenant-ID": tenant}
    return await sc.client.post(
        "/v1/chat/completions", json=chat_body(content, **fields), headers=headers
    )


# ------------------------------------------------------------------ sidecars


@pytest.fixture
async def vllm_sidecar_factory(vllm: VllmServer) -> AsyncIterator[VllmSidecarFactory]:
    """``make(server=..., **SidecarConfig fields)``: an in-process sidecar in front of a real
    vLLM server (default: :func:`vllm`); all are stopped after the test."""
    running: list[RunningSidecar] = []

    async def make(*, server: VllmServer | None = None, **overrides: Any) -> RunningSidecar:
        base: dict[str, Any] = dict(
            listen=("127.0.0.1", 0),
            admin_listen=("127.0.0.1", 0),
            upstream=(server or vllm).url,
            cache="test/cache",
            pod="pod-a",
            l1_bytes=8 * 1024 * 1024,
            trusted_proxies=("127.0.0.1/32",),
        )
        sidecar = SidecarServer(SidecarConfig.from_flat(**{**base, **overrides}))
        await sidecar.start()
        sc = RunningSidecar(sidecar)
        # Answers come from a real server: give them time on a loaded machine.
        sc.client.timeout = httpx.Timeout(60.0)
        running.append(sc)
        return sc

    yield make
    for sc in running:
        await sc.aclose()
