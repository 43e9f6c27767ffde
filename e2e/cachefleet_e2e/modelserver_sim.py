"""A model-server simulator that behaves like vLLM where routing and admission look.

For tests, the routing demo and admission end to end: an OpenAI-compatible
server (stdlib ``http.server``, one thread per connection, independent of the
sidecar's HTTP code) whose timing and ``/metrics`` follow the prompt's KV
prefix cache, not a fixed latency.

Model:

* a prompt is cut into blocks of ``block_tokens`` tokens of ``chars_per_token``
  characters each; block *i* is named by a hash chained over blocks 0..i (as
  vLLM's automatic prefix caching does), so only a shared *prefix* matches;
* the KV cache is an LRU of at most ``kv_blocks`` block hashes; a request's
  cached tokens are its leading blocks found there when its prefill starts;
* prefill is serial (one request at a time, FIFO) and takes
  ``uncached tokens / prefill_rate`` seconds; decoding is simplified to
  ``decode_s_per_token`` per output token (0 by default), outside the queue;
* answers are deterministic: the content is derived from the prompt and the
  model alone, so a cache in front can store and serve them.

Endpoints: ``POST /v1/chat/completions`` and ``/v1/completions``
(``"stream": true`` answers SSE chunks ending with ``data: [DONE]``);
``GET /metrics`` in vLLM's names (``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:prefix_cache_queries_total`` / ``_hits_total`` (tokens),
``vllm:prompt_tokens_total``, the histograms
``vllm:request_prefill_time_seconds`` and ``vllm:time_to_first_token_seconds``,
``vllm:cache_config_info{num_gpu_blocks,block_size}``); ``GET /health``;
``POST /_control`` with ``{"hold": true|false}`` stops / restarts the prefill
worker (requests then queue, a test's way to saturate the server without
load); ``GET /_stats`` returns the counters as JSON.

Run it: ``python -m cachefleet_e2e.modelserver_sim --listen 127.0.0.1:8000
--kv-blocks 2048 --prefill-rate 4000``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import signal
import threading
import time
from bisect import bisect_left
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from cachefleet_e2e.httpserver import StandInHTTPServer

#: Tokens per KV block (vLLM's default block size).
DEFAULT_BLOCK_TOKENS = 16
#: Characters per token of the simulated tokenizer.
DEFAULT_CHARS_PER_TOKEN = 4
#: Output tokens of a request that does not say (``max_tokens``).
DEFAULT_OUTPUT_TOKENS = 16
#: Most output tokens simulated per request.
MAX_OUTPUT_TOKENS = 4096
#: Histogram buckets, seconds (a subset of vLLM's).
BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                              0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


class SimError(ValueError):
    """A request the simulator refuses (400), with the reason."""


def prompt_of(path: str, request: Any) -> str:
    """The prompt text of an OpenAI request (chat messages joined by role)."""
    if not isinstance(request, dict):
        raise SimError("the body must be a JSON object")
    if path == "/v1/chat/completions":
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SimError("messages: a non-empty list is required")
        parts = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise SimError("messages: each needs a text content")
            parts.append(f"<{m.get('role', 'user')}>{m['content']}")
        return "".join(parts)
    prompt = request.get("prompt")
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        prompt = "".join(prompt)
    if not isinstance(prompt, str):
        raise SimError("prompt: text is required")
    return prompt


def block_hashes(prompt: str, block_chars: int) -> list[bytes]:
    """Chained hashes of the prompt's full blocks (a partial last block is never cached)."""
    out: list[bytes] = []
    parent = b""
    for i in range(len(prompt) // block_chars):
        chunk = prompt[i * block_chars : (i + 1) * block_chars].encode()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out


def answer_text(model: str, prompt: str, tokens: int) -> list[str]:
    """The deterministic answer: ``tokens`` words derived from the model and the prompt."""
    seed = hashlib.sha256(f"{model}\0{prompt}".encode()).hexdigest()
    return [f"w{seed[(2 * i) % 60 : (2 * i) % 60 + 4]}" for i in range(tokens)]


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(BUCKETS, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, acc = [], 0
        for bound, count in zip(BUCKETS, self.counts, strict=False):
            acc += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {acc}')
        acc += self.counts[-1]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {acc}')
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        out.append(f"{name}_count{{{labels}}} {acc}")
        return out


@dataclass
class _Job:
    hashes: list[bytes]
    tokens: int
    arrived: float
    done: threading.Event = field(default_factory=threading.Event)
    cached_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0


class ModelServerSim:
    """The simulator on a loopback port, served from a background thread."""

    def __init__(
        self,
        *,
        kv_blocks: int = 2048,
        prefill_rate: float = 4000.0,
        host: str = "127.0.0.1",
        port: int = 0,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        chars_per_token: int = DEFAULT_CHARS_PER_TOKEN,
        decode_s_per_token: float = 0.0,
        model: str = "sim",
    ) -> None:
        if kv_blocks < 1:
            raise ValueError(f"kv_blocks: must be >= 1, got {kv_blocks}")
        if not (math.isfinite(prefill_rate) and prefill_rate > 0):
            raise ValueError(f"prefill_rate: must be > 0 tokens/s, got {prefill_rate}")
        if block_tokens < 1 or chars_per_token < 1:
            raise ValueError("block_tokens and chars_per_token: must be >= 1")
        if not decode_s_per_token >= 0:
            raise ValueError(f"decode_s_per_token: must be >= 0, got {decode_s_per_token}")
        self.kv_blocks = kv_blocks
        self.prefill_rate = prefill_rate
        self.block_tokens = block_tokens
        self.chars_per_token = chars_per_token
        self.decode_s_per_token = decode_s_per_token
        self.model = model
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._kv: OrderedDict[bytes, None] = OrderedDict()
        self._held = False
        self._stopping = False
        self._prefilling: _Job | None = None
        self._decoding: dict[int, int] = {}  # id(job) -> blocks it holds
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.prompt_tokens = 0
        self.requests = 0
        self.prefill_hist = _Histogram()
        self.ttft_hist = _Histogram()
        handler = type("Handler", (_Handler,), {"sim": self})
        self.server = StandInHTTPServer((host, port), handler)
        self._threads: list[threading.Thread] = []

    # ---------------------------------------------------------------- lifecycle
    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ModelServerSim:
        self._threads = [
            threading.Thread(target=self._prefill_worker, daemon=True, name="sim-prefill"),
            threading.Thread(
                target=self.server.serve_forever, args=(0.05,), daemon=True, name="sim-http"
            ),
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> ModelServerSim:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def hold(self, held: bool = True) -> None:
        """Stop (or restart) the prefill worker: arriving requests queue meanwhile."""
        with self._cond:
            self._held = held
            self._cond.notify_all()

    def wait_queued(self, n: int, timeout_s: float = 10.0) -> bool:
        """Block until at least ``n`` requests wait for prefill (False on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._queue) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    # ------------------------------------------------------------------ model
    @property
    def block_chars(self) -> int:
        return self.block_tokens * self.chars_per_token

    def tokens_of(self, prompt: str) -> int:
        return max(1, math.ceil(len(prompt) / self.chars_per_token))

    def submit(self, prompt: str) -> _Job:
        """Queue a prompt for prefill; its job's ``done`` is set once prefilled."""
        job = _Job(block_hashes(prompt, self.block_chars), self.tokens_of(prompt), time.monotonic())
        with self._cond:
            self._queue.append(job)
            self.requests += 1
            self._cond.notify_all()
        return job

    def _prefill_worker(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (self._held or not self._queue):
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
                self._prefilling = job
                matched = 0
                for h in job.hashes:
                    if h not in self._kv:
                        break
                    matched += 1
                job.cached_tokens = min(job.tokens, matched * self.block_tokens)
                self._cond.notify_all()
            seconds = (job.tokens - job.cached_tokens) / self.prefill_rate
            if seconds > 0:
                time.sleep(seconds)
            with self._cond:
                for h in job.hashes:
                    self._kv[h] = None
                    self._kv.move_to_end(h)
                while len(self._kv) > self.kv_blocks:
                    self._kv.popitem(last=False)
                now = time.monotonic()
                job.prefill_s = seconds
                job.ttft_s = now - job.arrived
                self.prefix_queries_tokens += job.tokens
                self.prefix_hits_tokens += job.cached_tokens
                self.prompt_tokens += job.tokens
                self.prefill_hist.observe(seconds)
                self.ttft_hist.observe(job.ttft_s)
                self._prefilling = None
                self._decoding[id(job)] = math.ceil(job.tokens / self.block_tokens)
            job.done.set()

    def finished(self, job: _Job) -> None:
        """The job's decode is over: its blocks are no longer in use."""
        with self._cond:
            self._decoding.pop(id(job), None)

    # ---------------------------------------------------------------- metrics
    def snapshot(self) -> dict[str, float]:
        with self._cond:
            held_blocks = sum(self._decoding.values())
            if self._prefilling is not None:
                held_blocks += math.ceil(self._prefilling.tokens / self.block_tokens)
            return {
                "waiting": float(len(self._queue)),
                "running": float(len(self._decoding) + (self._prefilling is not None)),
                "kv_usage": min(1.0, held_blocks / self.kv_blocks),
                "kv_blocks_cached": float(len(self._kv)),
                "prefix_queries_tokens": float(self.prefix_queries_tokens),
                "prefix_hits_tokens": float(self.prefix_hits_tokens),
                "prompt_tokens": float(self.prompt_tokens),
                "requests": float(self.requests),
            }

    def metrics_text(self) -> str:
        s = self.snapshot()
        lab = f'model_name="{self.model}"'
        lines = [
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lab}}} {s['waiting']}",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lab}}} {s['running']}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lab}}} {s['kv_usage']}",
            "# TYPE vllm:prefix_cache_queries counter",
            f"vllm:prefix_cache_queries_total{{{lab}}} {s['prefix_queries_tokens']}",
            "# TYPE vllm:prefix_cache_hits counter",
            f"vllm:prefix_cache_hits_total{{{lab}}} {s['prefix_hits_tokens']}",
            "# TYPE vllm:prompt_tokens counter",
            f"vllm:prompt_tokens_total{{{lab}}} {s['prompt_tokens']}",
            "# TYPE vllm:request_prefill_time_seconds histogram",
        ]
        with self._cond:
            lines += self.prefill_hist.lines("vllm:request_prefill_time_seconds", lab)
            lines.append("# TYPE vllm:time_to_first_token_seconds histogram")
            lines += self.ttft_hist.lines("vllm:time_to_first_token_seconds", lab)
        lines += [
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.block_tokens}",'
            f'num_gpu_blocks="{self.kv_blocks}",enable_prefix_caching="True"}} 1.0',
        ]
        return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    sim: ModelServerSim
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        reason = self.responses.get(status, ("",))[0]
        head = (
            f"{self.protocol_version} {status} {reason}\r\n"
            f"content-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        self.wfile.write(head.encode("latin-1") + body)

    def _error(self, status: int, message: str) -> None:
        body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
        self._send(status, json.dumps(body).encode())

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/metrics":
            self._send(200, self.sim.metrics_text().encode(), "text/plain; version=0.0.4")
        elif path == "/health":
            self._send(200, b"")
        elif path == "/_stats":
            self._send(200, json.dumps(self.sim.snapshot()).encode())
        else:
            self._error(404, f"no route {path}")

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        if path == "/_control":
            try:
                doc = json.loads(body or b"{}")
            except ValueError:
                self._error(400, "invalid JSON")
                return
            if "hold" in doc:
                self.sim.hold(bool(doc["hold"]))
            self._send(200, b'{"ok": true}')
            return
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._error(404, f"no route {path}")
            return
        try:
            request = json.loads(body)
            prompt = prompt_of(path, request)
            max_tokens = request.get("max_tokens", DEFAULT_OUTPUT_TOKENS)
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise SimError("max_tokens: a positive integer is expected")
        except ValueError as exc:
            self._error(400, str(exc) if isinstance(exc, SimError) else "invalid JSON")
            return
        sim = self.sim
        model = str(request.get("model") or sim.model)
        words = answer_text(model, prompt, min(max_tokens, MAX_OUTPUT_TOKENS))
        job = sim.submit(prompt)
        job.done.wait()
        try:
            if request.get("stream") is True:
                self._stream(path, model, job, words)
            else:
                if sim.decode_s_per_token:
                    time.sleep(sim.decode_s_per_token * len(words))
                self._whole(path, model, job, words)
        finally:
            sim.finished(job)

    def _usage(self, job: _Job, words: list[str]) -> dict[str, Any]:
        return {
            "prompt_tokens": job.tokens,
            "completion_tokens": len(words),
            "total_tokens": job.tokens + len(words),
            "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
        }

    def _whole(self, path: str, model: str, job: _Job, words: list[str]) -> None:
        text = " ".join(words)
        chat = path == "/v1/chat/completions"
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if chat
            else {"index": 0, "text": text}
        )
        choice["finish_reason"] = "length"
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        answer = {
            "id": f"cmpl-{digest}",
            "object": "chat.completion" if chat else "text_completion",
            "created": 0,
            "model": model,
            "choices": [choice],
            "usage": self._usage(job, words),
        }
        self._send(200, json.dumps(answer).encode())

    def _stream(self, path: str, model: str, job: _Job, words: list[str]) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        chat = path == "/v1/chat/completions"
        digest = hashlib.sha256(" ".join(words).encode()).hexdigest()[:16]
        for i, word in enumerate(words):
            if i and self.sim.decode_s_per_token:
                time.sleep(self.sim.decode_s_per_token)
            piece = word if i == 0 else " " + word
            choice: dict[str, Any] = (
                {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            )
            choice["finish_reason"] = "length" if i == len(words) - 1 else None
            event = {
                "id": f"cmpl-{digest}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0,
                "model": model,
                "choices": [choice],
            }
            self._chunk(f"data: {json.dumps(event)}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _positive(kind: type[int] | type[float]) -> Any:
    def conv(value: str) -> int | float:
        number = kind(value)
        if not (math.isfinite(number) and number > 0):
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}")
        return number

    return conv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="modelserver-sim", description=__doc__.splitlines()[0])
    p.add_argument("--listen", type=_listen, default=("127.0.0.1", 8000), help="HOST:PORT")
    p.add_argument("--kv-blocks", type=_positive(int), default=2048, help="KV capacity, blocks")
    p.add_argument("--prefill-rate", type=_positive(float), default=4000.0, help="prefill tokens/s")
    p.add_argument("--block-tokens", type=_positive(int), default=DEFAULT_BLOCK_TOKENS)
    p.add_argument("--chars-per-token", type=_positive(int), default=DEFAULT_CHARS_PER_TOKEN)
    p.add_argument(
        "--decode-time-per-token", type=float, default=0.0, help="seconds per output token"
    )
    p.add_argument("--model", default="sim", help="model name in answers and metrics")
    args = p.parse_args(argv)
    if not args.decode_time_per_token >= 0:
        p.error("--decode-time-per-token: expected seconds >= 0")
    sim = ModelServerSim(
        kv_blocks=args.kv_blocks,
        prefill_rate=args.prefill_rate,
        host=args.listen[0],
        port=args.listen[1],
        block_tokens=args.block_tokens,
        chars_per_token=args.chars_per_token,
        decode_s_per_token=args.decode_time_per_token,
        model=args.model,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sim.start()
    print(f"model-server simulator on {sim.url}", flush=True)
    stop.wait()  # until SIGTERM or SIGINT; then the server closes its socket
    sim.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
