"""The routing part of ``cachefleet demo``: cachefleet's picker against round-robin.

Starts ``--pods`` model-server simulators (:mod:`cachefleet_e2e.modelserver_sim`:
an LRU KV prefix cache, prefill time proportional to uncached tokens, a
serial prefill queue, vLLM's metric names), then sends the same multi-turn
conversation load twice, open loop on a fixed schedule:

1. through the stand-in gateway (:mod:`cachefleet_e2e.gateway`) in
   round-robin mode;
2. through the same gateway asking ``cachefleet router`` (the endpoint
   picker, over Envoy's ``ext_proc``), on fresh simulators.

The load: a few long system prompts shared by many conversations, each
conversation a handful of turns whose prompt is the whole history so far
(as chat clients send it). What routing can win is the prefix each pod
already holds. Each simulated pod's KV cache (400 blocks of 16 tokens by
default) holds a system prompt and a few conversations, not everything: a
pod that sees every conversation (round-robin) keeps evicting what the next
turn needs. Measured at the client: time to the first streamed chunk
(TTFT); read from each simulator's ``/metrics``: prefix-cache hits per pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import httpx

from cachefleet_common.modelserver import ModelServerMetrics, parse_metrics

from .gateway import Gateway
from .services import free_port

#: How long a simulator or the router may take to answer after start, seconds.
START_TIMEOUT_S = 20.0
#: Requests in flight at most at the client (open loop: the schedule decides, this bounds).
MAX_IN_FLIGHT = 256
#: The modes compared, in run order: the gateway alone, then asking the router.
MODES = ("round-robin", "cachefleet")


@dataclass(frozen=True, slots=True)
class RoutingLoad:
    """A deterministic multi-turn schedule."""

    conversations: int = 40
    turns: int = 5
    system_prompts: int = 4
    #: characters of each system prompt and of each user turn
    system_chars: int = 8000
    turn_chars: int = 1200
    #: requests per second, all conversations together (open loop)
    rate: float = 8.0
    seed: int = 11

    def schedule(self) -> list[tuple[float, int, int]]:
        """(send time, conversation, turn) in send order.

        Conversations start one after another and interleave: turn t of
        conversation c is due when the global sequence reaches it, one request
        every 1/rate seconds, so a conversation's turns are spread out and
        other conversations' requests fall in between.
        """
        rng = random.Random(self.seed)
        pending = {c: 0 for c in range(self.conversations)}
        order: list[tuple[int, int]] = []
        active: list[int] = []
        next_conv = 0
        while pending:
            while len(active) < 8 and next_conv < self.conversations:
                active.append(next_conv)
                next_conv += 1
            c = rng.choice(active)
            order.append((c, pending[c]))
            pending[c] += 1
            if pending[c] == self.turns:
                del pending[c]
                active.remove(c)
        return [(i / self.rate, c, t) for i, (c, t) in enumerate(order)]

    def describe(self) -> dict[str, Any]:
        """The load as a result records it."""
        return {
            "conversations": self.conversations,
            "turns": self.turns,
            "rate": self.rate,
            "system_prompts": self.system_prompts,
        }

    def body(self, conversation: int, turn: int) -> dict[str, Any]:
        rng = random.Random(self.seed * 1_000_003 + conversation)
        system = conversation % self.system_prompts
        messages: list[dict[str, str]] = [
            {"role": "system", "content": _text(f"system {system}", self.system_chars)}
        ]
        for k in range(turn + 1):
            messages.append(
                {
                    "role": "user",
                    "content": _text(f"c{conversation} t{k} {rng.random()}", self.turn_chars),
                }
            )
            if k < turn:
                messages.append({"role": "assistant", "content": f"answer {conversation}.{k}"})
        return {
            "model": "demo-llm",
            "messages": messages,
            "temperature": 0,
            "max_tokens": 8,
            "stream": True,
        }


def _text(seed: str, chars: int) -> str:
    rng = random.Random(seed)
    words = ("cache", "prefix", "token", "fleet", "model", "query", "answer", "tenant", "pod")
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(words)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


@dataclass(slots=True)
class Phase:
    """One mode's run: what the clients saw and what the pods did."""

    mode: str
    ttft_s: list[float] = field(default_factory=list)
    errors: int = 0
    per_pod: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.ttft_s)

        def q(p: float) -> float:
            return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else math.nan

        queries = sum(p["prefix_queries"] for p in self.per_pod.values())
        hits = sum(p["prefix_hits"] for p in self.per_pod.values())
        return {
            "mode": self.mode,
            "requests": len(self.ttft_s) + self.errors,
            "errors": self.errors,
            "ttft_mean_s": sum(ordered) / len(ordered) if ordered else math.nan,
            "ttft_p50_s": q(0.5),
            "ttft_p95_s": q(0.95),
            "prefix_hit_ratio": hits / queries if queries else math.nan,
            "per_pod": self.per_pod,
        }


def _python_module(module: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text(errors='replace')[-1500:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=0.5).status_code < 500:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {START_TIMEOUT_S:g}s")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


@contextlib.contextmanager
def simulators(
    pods: int, *, kv_blocks: int, prefill_rate: float, workdir: Path
) -> Iterator[list[str]]:
    """``pods`` fresh simulators on loopback; yields their ``host:port``."""
    procs: list[subprocess.Popen[bytes]] = []
    addresses: list[str] = []
    try:
        for i in range(pods):
            address = f"127.0.0.1:{free_port()}"
            log = workdir / f"sim-{i}.log"
            proc = _python_module(
                "cachefleet_e2e.modelserver_sim",
                "--listen",
                address,
                "--kv-blocks",
                str(kv_blocks),
                "--prefill-rate",
                str(prefill_rate),
                "--model",
                "demo-llm",
                log=log,
            )
            procs.append(proc)
            addresses.append(address)
            _wait_http(f"http://{address}/health", proc, log)
        yield addresses
    finally:
        _stop(procs)


@contextlib.contextmanager
def router(endpoints: list[str], workdir: Path) -> Iterator[str]:
    """``cachefleet router`` over ``endpoints``; yields its ext_proc address."""
    grpc_address = f"127.0.0.1:{free_port()}"
    metrics_address = f"127.0.0.1:{free_port()}"
    log = workdir / "router.log"
    proc = _python_module(
        "cachefleet_operator.cli",
        "router",
        "--grpc-listen",
        grpc_address,
        "--metrics-listen",
        metrics_address,
        "--endpoints",
        ",".join(endpoints),
        "--scrape-interval",
        "0.25",
        log=log,
    )
    try:
        _wait_http(f"http://{metrics_address}/readyz", proc, log)
        yield grpc_address
    finally:
        _stop([proc])


async def _serve_gateway(gateway: Gateway) -> tuple[aiohttp.web.AppRunner, str]:
    await gateway.start()
    app = aiohttp.web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", gateway.handle)
    runner = aiohttp.web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def drive(url: str, load: RoutingLoad, phase: Phase) -> None:
    """Send ``load``'s schedule to ``url``; record the time to each answer's first chunk."""
    limits = httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=64)
    gate = asyncio.Semaphore(MAX_IN_FLIGHT)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:

        async def one(conversation: int, turn: int) -> None:
            async with gate:
                t0 = time.perf_counter()
                try:
                    async with client.stream(
                        "POST", url + "/v1/chat/completions", json=load.body(conversation, turn)
                    ) as resp:
                        first: float | None = None
                        async for _ in resp.aiter_raw():
                            if first is None:
                                first = time.perf_counter() - t0
                        if resp.status_code != 200 or first is None:
                            phase.errors += 1
                        else:
                            phase.ttft_s.append(first)
                except httpx.HTTPError:
                    phase.errors += 1

        start = time.monotonic()
        tasks: list[asyncio.Task[None]] = []
        for due, conversation, turn in load.schedule():
            delay = start + due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(conversation, turn)))
        await asyncio.gather(*tasks)


async def through_gateway(
    mode: str, endpoints: list[str], load: RoutingLoad, phase: Phase, workdir: Path
) -> Gateway:
    """``load`` through the stand-in gateway over ``endpoints``, in ``mode``: round-robin,
    or asking ``cachefleet router``. The gateway returned has counted where it routed."""
    with contextlib.ExitStack() as stack:
        if mode == "round-robin":
            gateway = Gateway(picker=None, endpoints=endpoints)
        else:
            picker = stack.enter_context(router(endpoints, workdir))
            gateway = Gateway(picker=picker, endpoints=endpoints)
        runner, url = await _serve_gateway(gateway)
        try:
            await drive(url, load, phase)
        finally:
            await runner.cleanup()
            await gateway.close()
    return gateway


def pod_counters(
    routed: int, metrics: ModelServerMetrics, before: ModelServerMetrics | None = None
) -> dict[str, float]:
    """One pod's line of a phase: the requests routed to it and its prefix-cache counters
    (what they grew by since ``before``, when the pod served earlier phases)."""
    then = before or ModelServerMetrics()  # counters of a fresh pod: none yet
    return {
        "requests": float(routed),
        "prefix_queries": _grown(metrics.prefix_queries_total, then.prefix_queries_total),
        "prefix_hits": _grown(metrics.prefix_hits_total, then.prefix_hits_total),
        "prompt_tokens": _grown(metrics.prompt_tokens_total, then.prompt_tokens_total),
    }


def _grown(now: float | None, then: float | None) -> float:
    return (now or 0.0) - (then or 0.0)


def _pod_metrics(addresses: list[str], gateway: Gateway) -> dict[str, dict[str, float]]:
    return {
        address: pod_counters(
            gateway.routed.get(address, 0),
            parse_metrics(httpx.get(f"http://{address}/metrics", timeout=2.0).text),
        )
        for address in addresses
    }


async def run_phase(
    mode: str, load: RoutingLoad, *, pods: int, kv_blocks: int, prefill_rate: float, workdir: Path
) -> Phase:
    phase = Phase(mode)
    with simulators(pods, kv_blocks=kv_blocks, prefill_rate=prefill_rate, workdir=workdir) as sims:
        gateway = await through_gateway(mode, sims, load, phase, workdir)
        phase.per_pod = await asyncio.to_thread(_pod_metrics, sims, gateway)
    return phase


async def run_modes(
    load: RoutingLoad,
    run: Callable[[str, Path], Awaitable[Phase]],
    *,
    over: str,
    workdir_prefix: str,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Each of :data:`MODES` in turn on ``load`` (``run``: one mode's phase, given its
    working directory); the summary of each. ``over`` names the pods in the progress."""
    phases = []
    with tempfile.TemporaryDirectory(prefix=workdir_prefix) as tmp:
        for mode in MODES:
            if progress:
                n = load.conversations * load.turns
                print(f"routing: {mode}: {n} requests at {load.rate:g}/s over {over}", flush=True)
            phase = await run(mode, Path(tmp))
            phases.append(phase.summary())
    return phases


async def compare(
    load: RoutingLoad,
    *,
    pods: int = 4,
    kv_blocks: int = 400,
    prefill_rate: float = 15_000.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Both modes on the same load, one after the other, on fresh simulators each."""

    def run(mode: str, workdir: Path) -> Awaitable[Phase]:
        return run_phase(
            mode, load, pods=pods, kv_blocks=kv_blocks, prefill_rate=prefill_rate, workdir=workdir
        )

    phases = await run_modes(
        load,
        run,
        over=f"{pods} simulated pods",
        workdir_prefix="cachefleet-routing-",
        progress=progress,
    )
    return {
        "pods": pods,
        "kv_blocks": kv_blocks,
        "prefill_rate": prefill_rate,
        "load": load.describe(),
        "phases": phases,
    }


def print_report(result: dict[str, Any]) -> None:
    """The phases side by side, the TTFT ratio, and each pod's share and hits."""
    print("\nrouting: the same conversations, two routers")
    print(
        f"  {'mode':<12} {'requests':>8} {'errors':>6} {'TTFT mean':>10} {'p50':>8} {'p95':>8}"
        f" {'prefix hits':>11}"
    )
    for p in result["phases"]:
        print(
            f"  {p['mode']:<12} {p['requests']:>8} {p['errors']:>6} "
            f"{p['ttft_mean_s'] * 1000:>8.0f}ms {p['ttft_p50_s'] * 1000:>6.0f}ms "
            f"{p['ttft_p95_s'] * 1000:>6.0f}ms {p['prefix_hit_ratio']:>10.0%}"
        )
    phases = {p["mode"]: p for p in result["phases"]}
    if {"round-robin", "cachefleet"} <= phases.keys():
        rr, cf = phases["round-robin"], phases["cachefleet"]
        if rr["ttft_mean_s"] > 0:
            print(
                "  cachefleet / round-robin mean TTFT: "
                f"{cf['ttft_mean_s'] / rr['ttft_mean_s']:.2f}x"
            )
    for p in result["phases"]:
        line = "  ".join(
            f"{addr.rsplit(':', 1)[1]}: {int(v['requests'])} req, "
            f"{(v['prefix_hits'] / v['prefix_queries']) if v['prefix_queries'] else 0:.0%} hits"
            for addr, v in sorted(p["per_pod"].items())
        )
        print(f"  {p['mode']:<12} per pod  {line}")


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return False
    phases = result["phases"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [p["mode"] for p in phases]
    for i, metric in enumerate(("ttft_p50_s", "ttft_mean_s", "ttft_p95_s")):
        axes[0].bar(
            [x + i * 0.25 for x in range(len(phases))],
            [p[metric] * 1000 for p in phases],
            width=0.25,
            label=metric.removeprefix("ttft_").removesuffix("_s"),
        )
    axes[0].set_xticks([x + 0.25 for x in range(len(phases))], labels)
    axes[0].set_ylabel("time to first token (ms)")
    axes[0].legend(fontsize=8)
    width = 0.8 / max(1, len(phases))
    for i, p in enumerate(phases):
        pods = sorted(p["per_pod"])
        ratios = [
            (p["per_pod"][a]["prefix_hits"] / p["per_pod"][a]["prefix_queries"])
            if p["per_pod"][a]["prefix_queries"]
            else 0.0
            for a in pods
        ]
        axes[1].bar([x + i * width for x in range(len(pods))], ratios, width=width, label=p["mode"])
    slots = max(len(p["per_pod"]) for p in phases)
    centre = width * (len(phases) - 1) / 2
    axes[1].set_xticks([x + centre for x in range(slots)], [f"pod {x}" for x in range(slots)])
    axes[1].set_xlabel("pod (sorted by address within each run)")
    axes[1].set_ylabel("prefix-cache hit ratio (tokens)")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("cachefleet demo: KV-prefix-aware routing vs round-robin, same load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write(
    result: dict[str, Any], out: Path, *, name: str = "routing", plotted: bool = True
) -> list[str]:
    """``<name>.json`` (and ``<name>.png``) under ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    written = [str(out / f"{name}.json")]
    if plotted and plot(result, out / f"{name}.png"):
        written.append(str(out / f"{name}.png"))
    return written
