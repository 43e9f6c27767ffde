"""Capture what a real vLLM server says, for decoders tested without one (see README.md here).

Run from the repository root with the project's venv (pyzmq, msgpack, httpx) and vLLM's
venv present (``make vllm-env``)::

    PYTHONPATH=e2e .venv/bin/python tests/data/vllm/capture.py

It starts one vLLM server on the tiny model with a KV cache of only
:data:`NUM_BLOCKS` blocks (so long prompts evict), subscribes to its KV events, drives a
fixed sequence of requests, and rewrites the files of this directory.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import zmq

from cachefleet_e2e.vllm_server import SERVED_MODEL, VllmServer, tiny_model

HERE = Path(__file__).resolve().parent
#: 40 blocks of 32 tokens: 1280 tokens, room for one 1024-token request plus a little.
NUM_BLOCKS = 40
BLOCK_SIZE = 32
#: Seconds of silence on the KV-event socket that end the capture.
QUIET_S = 3.0


def write(name: str, data: Any) -> None:
    path = HERE / name
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print("wrote", path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path)


def frame_record(parts: list[bytes]) -> dict[str, Any]:
    topic, seq, payload = parts
    return {
        "frames_b64": [base64.b64encode(p).decode() for p in parts],
        "topic": topic.decode(),
        "seq": int.from_bytes(seq, "big"),
        "decoded": msgpack.unpackb(payload, raw=False, strict_map_key=False),
    }


def event_types(record: dict[str, Any]) -> list[str]:
    events = record["decoded"][1]
    return [e["type"] if isinstance(e, dict) else str(e[0]) for e in events]


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.connect(endpoint)
        self.frames: list[list[bytes]] = []
        self.last = time.monotonic()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping:
            try:
                self.frames.append(self.sock.recv_multipart())
                self.last = time.monotonic()
            except zmq.Again:
                continue

    def drain(self) -> None:
        """Wait (bounded: 30 s) until the socket has been quiet for QUIET_S."""
        deadline = time.monotonic() + 30
        while time.monotonic() - self.last < QUIET_S and time.monotonic() < deadline:
            time.sleep(0.1)

    def close(self) -> None:
        self.stopping = True
        self.thread.join(timeout=5)
        self.sock.close(linger=0)
        self.ctx.term()


def long_prompt(seed: int, words: int) -> str:
    vocabulary = ["cache", "prefix", "block", "tenant", "router", "model", "server", "token"]
    return " ".join(vocabulary[(seed * 7 + i * (seed + 3)) % len(vocabulary)] for i in range(words))


def main() -> int:
    model = tiny_model()
    server = VllmServer(model.path, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, name="capture")
    server.start()
    sub = Subscriber(server.kv_events_endpoint)
    time.sleep(1.0)  # ZMQ's slow joiner: let the subscription reach the publisher
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            write("models.json", http.get("/v1/models").json())
            write("kv_event_sources.json", http.get("/kv_event_sources").json())
            write("metrics_idle.txt", http.get("/metrics").text)
            prompt = {"model": SERVED_MODEL, "prompt": "hello world, tell me about the cache"}
            messages = {
                "model": SERVED_MODEL,
                "messages": [
                    {"role": "system", "content": "You are a cache."},
                    {"role": "user", "content": "hello world, tell me about the cache"},
                ],
            }
            write(
                "tokenize_prompt.json",
                {"request": prompt, "response": http.post("/tokenize", json=prompt).json()},
            )
            write(
                "tokenize_messages.json",
                {"request": messages, "response": http.post("/tokenize", json=messages).json()},
            )

            # 1. Stored: a 3-block chat prompt, then the same again (a prefix hit: nothing new
            #    is stored for the prompt's blocks).
            chat = {
                **messages,
                "messages": [
                    *messages["messages"][:1],
                    {"role": "user", "content": long_prompt(1, 80)},
                ],
                "temperature": 0,
                "max_tokens": 8,
                "ignore_eos": True,
            }
            first = http.post("/v1/chat/completions", json=chat)
            write("chat_completion.json", {"request": chat, "response": first.json()})
            http.post("/v1/chat/completions", json=chat)
            with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
                write("chat_completion_stream.txt", "".join(s.iter_text()))
            sub.drain()
            stored_upto = len(sub.frames)

            # 2. Removed: three different ~700-token prompts through a 40-block cache.
            for seed in (2, 3, 4):
                body = {
                    "model": SERVED_MODEL,
                    "prompt": long_prompt(seed, 700),
                    "temperature": 0,
                    "max_tokens": 8,
                    "ignore_eos": True,
                }
                http.post("/v1/completions", json=body).raise_for_status()
            sub.drain()
            removed_upto = len(sub.frames)

            # 3. Cleared: reset the prefix cache; the event goes out with the next step.
            reset = http.post("/reset_prefix_cache")
            write("reset_prefix_cache.json", {"status": reset.status_code, "body": reset.text})
            http.post(
                "/v1/completions",
                json={"model": SERVED_MODEL, "prompt": "after the reset", "max_tokens": 2},
            ).raise_for_status()
            sub.drain()
            write("metrics.txt", http.get("/metrics").text)
    finally:
        sub.close()
        server.stop()

    records = [frame_record(parts) for parts in sub.frames]
    write(
        "kv_events_sequence.json",
        {
            "note": "every frame of the capture, in order; see README.md",
            "block_size": BLOCK_SIZE,
            "num_blocks": NUM_BLOCKS,
            "frames": records,
        },
    )

    def having(kind: str, chosen: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in chosen if kind in event_types(r)]

    write("kv_events_stored.json", {"frames": records[:stored_upto]})
    write("kv_events_removed.json", {"frames": having("BlockRemoved", records[:removed_upto])})
    write("kv_events_cleared.json", {"frames": having("AllBlocksCleared", records)})
    counts: dict[str, int] = {}
    for record in records:
        for kind in event_types(record):
            counts[kind] = counts.get(kind, 0) + 1
    print("frames:", len(records), "events:", counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
