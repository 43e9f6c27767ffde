"""``make demo-vllm``: the routing part of ``cachefleet demo`` over real vLLM servers.

The same comparison as :mod:`cachefleet_e2e.routing_demo` (the same multi-turn
conversations, open loop, first through the stand-in gateway in round-robin mode,
then through the gateway asking ``cachefleet router``), but the pods are real vLLM
servers (:mod:`cachefleet_e2e.vllm_server`: vLLM for the CPU serving the tiny local
model) instead of the simulator. The servers start once; before each phase their prefix
caches are reset (``/reset_prefix_cache``) and the prefix-cache counters each phase
reports are the difference of vLLM's own ``vllm:prefix_cache_queries_total`` /
``hits_total`` across it.

Each server's KV cache is sized (``--kv-blocks``) to hold a system prompt and a few
conversations, as the simulator's is, so a pod that sees every conversation keeps
evicting what the next turn needs. The model's text is random; the comparison is about
where the prompts go and what vLLM's cache finds there.

Needs vLLM's venv (``make vllm-env``). Writes ``routing-vllm.json`` (and a plot) under
``--out``, beside the simulator demo's files. The load, the gateway's modes, the per-pod
counters and the report are the simulator demo's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cachefleet_common.modelserver import ModelServerMetrics, parse_metrics

from . import routing_demo
from .routing_demo import Phase, RoutingLoad
from .services import ServiceError
from .vllm_server import VllmServer, VllmUnavailable, start_all, tiny_model

#: At most this many servers (1.2 GB and a CPU core's worth of start-up each).
MAX_PODS = 3
#: KV blocks per server (32 tokens each): about a system prompt and a few conversations
#: of the default load (~1600-token system prompts, ~240-token turns).
DEFAULT_KV_BLOCKS = 160
#: Longest prompt the servers accept, tokens (the default load's last turns are ~3000).
MAX_MODEL_LEN = 4096
#: Conversations of the default load (the simulator demo has 40): about a minute per mode.
DEFAULT_CONVERSATIONS = 24
#: Requests per second of the default load (the simulator demo sends 8; real prefill on
#: two CPU cores is slower).
DEFAULT_RATE = 4.0


@dataclass(frozen=True, slots=True)
class VllmLoad(RoutingLoad):
    """:class:`RoutingLoad` asking for the model the servers serve."""

    model: str = "demo-llm"

    def body(self, conversation: int, turn: int) -> dict[str, Any]:
        body = RoutingLoad.body(self, conversation, turn)
        body["model"] = self.model
        body["ignore_eos"] = True  # the random model may end at once; every answer has 8 tokens
        return body


def _address(server: VllmServer) -> str:
    return f"127.0.0.1:{server.port}"


async def _counters(
    http: httpx.AsyncClient, servers: Sequence[VllmServer]
) -> dict[str, ModelServerMetrics]:
    out = {}
    for server in servers:
        out[_address(server)] = parse_metrics((await http.get(f"{server.url}/metrics")).text)
    return out


async def run_phase(
    mode: str, load: RoutingLoad, servers: Sequence[VllmServer], workdir: Path
) -> Phase:
    """One mode over the running servers, their prefix caches reset first."""
    phase = Phase(mode)
    addresses = [_address(s) for s in servers]
    async with httpx.AsyncClient(timeout=60.0) as http:
        for server in servers:
            (await http.post(f"{server.url}/reset_prefix_cache")).raise_for_status()
        before = await _counters(http, servers)
        gateway = await routing_demo.through_gateway(mode, addresses, load, phase, workdir)
        after = await _counters(http, servers)
    phase.per_pod = {
        address: routing_demo.pod_counters(
            gateway.routed.get(address, 0), after[address], before[address]
        )
        for address in addresses
    }
    return phase


async def compare_on(
    servers: Sequence[VllmServer], load: RoutingLoad, *, progress: bool = True
) -> dict[str, Any]:
    """Both modes, one after the other, over ``servers`` (already running)."""

    def run(mode: str, workdir: Path) -> Awaitable[Phase]:
        return run_phase(mode, load, servers, workdir)

    phases = await routing_demo.run_modes(
        load,
        run,
        over=f"{len(servers)} vLLM servers",
        workdir_prefix="cachefleet-routing-vllm-",
        progress=progress,
    )
    return {
        "backend": "vllm",
        "pods": len(servers),
        "kv_blocks": servers[0].num_blocks if servers else None,
        "block_size": servers[0].block_size if servers else None,
        "load": load.describe(),
        "phases": phases,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cachefleet_e2e.routing_demo_vllm", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pods", type=int, default=MAX_PODS, choices=range(1, MAX_PODS + 1))
    parser.add_argument("--conversations", type=int, default=DEFAULT_CONVERSATIONS)
    parser.add_argument("--rate", type=float, default=DEFAULT_RATE, help="requests per second")
    parser.add_argument("--kv-blocks", type=int, default=DEFAULT_KV_BLOCKS)
    parser.add_argument("--seed", type=int, default=RoutingLoad().seed)
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    load = VllmLoad(conversations=args.conversations, rate=args.rate, seed=args.seed)
    try:
        model = tiny_model()
    except VllmUnavailable as exc:
        print(f"demo-vllm: {exc}", file=sys.stderr)
        return 2
    servers = [
        VllmServer(
            model.path,
            name=f"demo-vllm-{i}",
            served_model=load.model,
            max_model_len=MAX_MODEL_LEN,
            num_blocks=args.kv_blocks,
        )
        for i in range(args.pods)
    ]
    print(f"starting {args.pods} vLLM servers ({args.kv_blocks} KV blocks each)", flush=True)
    try:
        start_all(servers)
        print(
            "  healthy after " + ", ".join(f"{s.start_s:.1f}" for s in servers if s.start_s) + " s",
            flush=True,
        )
        result = asyncio.run(compare_on(servers, load))
    except ServiceError as exc:
        print(f"demo-vllm: {exc}", file=sys.stderr)
        return 1
    finally:
        for server in servers:
            server.stop()
    routing_demo.print_report(result)
    written = routing_demo.write(result, args.out, name="routing-vllm", plotted=not args.no_plot)
    print("\nwrote " + ", ".join(written))
    failed = sum(int(p["errors"]) for p in result["phases"])
    if failed:
        print(f"routing: {failed} requests failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
