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
``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cachefleet_common.modelserver import parse_metrics

from . import routing_demo
from .gateway import Gateway
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


async def _counters(http: httpx.AsyncClient, servers: Sequence[VllmServer]) -> dict[str, Any]:
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
        with contextlib.ExitStack() as stack:
            if mode == "round-robin":
                gateway = Gateway(picker=None, endpoints=addresses)
            else:
                picker = stack.enter_context(routing_demo.router(addresses, workdir))
                gateway = Gateway(picker=picker, endpoints=addresses)
            runner, url = await routing_demo._serve_gateway(gateway)
            try:
                await routing_demo.drive(url, load, phase)
            finally:
                await runner.cleanup()
                await gateway.close()
        after = await _counters(http, servers)
    for address in addresses:
        a, b = after[address], before[address]
        phase.per_pod[address] = {
            "requests": float(gateway.routed.get(address, 0)),
            "prefix_queries": (a.prefix_queries_total or 0.0) - (b.prefix_queries_total or 0.0),
            "prefix_hits": (a.prefix_hits_total or 0.0) - (b.prefix_hits_total or 0.0),
            "prompt_tokens": (a.prompt_tokens_total or 0.0) - (b.prompt_tokens_total or 0.0),
        }
    return phase


async def compare_on(
    servers: Sequence[VllmServer], load: RoutingLoad, *, progress: bool = True
) -> dict[str, Any]:
    """Both modes, one after the other, over ``servers`` (already running)."""
    out: dict[str, Any] = {
        "backend": "vllm",
        "pods": len(servers),
        "kv_blocks": servers[0].num_blocks if servers else None,
        "block_size": servers[0].block_size if servers else None,
        "load": {
            "conversations": load.conversations,
            "turns": load.turns,
            "rate": load.rate,
            "system_prompts": load.system_prompts,
        },
        "phases": [],
    }
    with tempfile.TemporaryDirectory(prefix="cachefleet-routing-vllm-") as tmp:
        for mode in ("round-robin", "cachefleet"):
            if progress:
                n = load.conversations * load.turns
                print(
                    f"routing: {mode}: {n} requests at {load.rate:g}/s "
                    f"over {len(servers)} vLLM servers",
                    flush=True,
                )
            phase = await run_phase(mode, load, servers, Path(tmp))
            out["phases"].append(phase.summary())
    return out


def write(result: dict[str, Any], out: Path, *, plotted: bool = True) -> list[str]:
    """``routing-vllm.json`` (and ``routing-vllm.png``): beside the simulator demo's files."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing-vllm.json").write_text(json.dumps(result, indent=2))
    written = [str(out / "routing-vllm.json")]
    if plotted and routing_demo.plot(result, out / "routing-vllm.png"):
        written.append(str(out / "routing-vllm.png"))
    return written


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
    print("\nwrote " + ", ".join(write(result, args.out, plotted=not args.no_plot)))
    failed = sum(int(p["errors"]) for p in result["phases"])
    if failed:
        print(f"routing: {failed} requests failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
