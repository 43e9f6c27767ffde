"""A stand-in OpenAI-compatible model server for tests and the demo.

Deliberately independent of the sidecar's own HTTP code (stdlib
``http.server``, one thread per connection), so a bug in the sidecar cannot
hide behind the same bug in its test peer.

Behaviour:

* ``POST /v1/chat/completions`` / ``/v1/completions`` answer deterministically
  from the request (the answer names a hash of the body and a per-process call
  number, so a test can tell a cached answer from a fresh one);
  ``/v1/embeddings`` answers a real, lexical embedding of each input: hashed
  character n-grams (:func:`embed`; the call number is its ``id``);
  ``"stream": true`` answers as SSE with several events and
  ``data: [DONE]`` (with ``stream_options.include_usage``, a last chunk that
  carries the usage, as OpenAI sends it; JSON answers always carry
  ``usage`` 5 prompt + 3 completion tokens).
* Per-tenant latency (``X-Tenant-ID``) and faults are set through
  :class:`FakeUpstream` attributes, or ``POST /_control`` from another
  process: ``{"latency_s": {"tenant": 0.05}, "default_latency_s": 0,
  "fail_next": 2, "fail_status": 500, "truncate_next": 1,
  "break_stream_next": 1, "invalid_json_next": 1, "error_object_next": 1,
  "sse_error_next": 1, "sse_no_done_next": 1, "drop_next": 1, "pad_bytes": 0,
  "event_gap_s": 0}``. The tenant's latency comes before the answer (a stream's
  first event), ``event_gap_s`` between a stream's token events (inter-token latency).
  ``error_object_next`` answers 200 with an OpenAI error object;
  ``sse_error_next`` ends a stream with an error event (then ``[DONE]``),
  ``sse_no_done_next`` ends it cleanly but without ``data: [DONE]``;
  ``drop_next`` reads the next request (any path) and closes the
  connection without an answer; ``pad_bytes`` makes every JSON answer that much larger;
  ``fixed_answers`` (``{question: text}``) answers a chat whose last message is that
  question with that text (two questions, one answer: tests that compare answers).
* ``calls`` counts every request that reached the stand-in, by path.
* ``GET /_stats`` returns call counts; every other path echoes the method,
  path, headers and body as JSON (status 200, or ``?status=N``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cachefleet_e2e.httpserver import StandInHTTPServer
from cachefleet_sidecar.cache.semantic import hashed_ngrams

#: Characters of an input the stand-in embeds (a real model truncates at its sequence length).
EMBED_MAX_CHARS = 8192
#: Dimension of the stand-in's embeddings (all-MiniLM-L6-v2's).
EMBED_DIM = 384


def embed(text: str) -> list[float]:
    """The stand-in's embedding: hashed character 3-5-grams (:func:`semantic.hashed_ngrams`)."""
    return [round(float(x), 6) for x in hashed_ngrams(text[:EMBED_MAX_CHARS], EMBED_DIM)]


class FakeUpstream:
    """Runs the stand-in on a free loopback port in a background thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.latency_s: dict[str, float] = {}
        self.default_latency_s = 0.0
        self.fail_next = 0
        self.fail_status = 500
        self.truncate_next = 0
        self.break_stream_next = 0
        self.invalid_json_next = 0
        self.error_object_next = 0
        self.sse_error_next = 0
        self.sse_no_done_next = 0
        self.drop_next = 0
        self.pad_bytes = 0
        self.event_gap_s = 0.0
        self.fixed_answers: dict[str, str] = {}
        self.calls: Counter[str] = Counter()
        self.seen_headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._counter = 0
        handler = type("Handler", (_Handler,), {"upstream": self})
        self.server = StandInHTTPServer((host, port), handler)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeUpstream:
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FakeUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def next_number(self) -> int:
        with self._lock:
            self._counter += 1
            return self._counter

    def take(self, attr: str) -> bool:
        """Consume one pending fault of kind ``attr``."""
        with self._lock:
            left = int(getattr(self, attr))
            if left > 0:
                setattr(self, attr, left - 1)
                return True
            return False

    def control(self, doc: dict[str, Any]) -> None:
        with self._lock:
            for name, value in doc.items():
                if name == "latency_s":
                    self.latency_s.update({str(k): float(v) for k, v in value.items()})
                elif hasattr(self, name) and not name.startswith("_"):
                    setattr(self, name, value)


class _Handler(BaseHTTPRequestHandler):
    upstream: FakeUpstream
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: without TCP_NODELAY, Nagle holds
    # the body until the client's delayed ACK (~40 ms), an artefact no real
    # model server has.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _body(self) -> bytes:
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        """Head and body in one write, as a real server sends a small answer: the
        proxy then reads it whole, however loaded the machine (``send_response``
        and ``end_headers`` would write the head on its own)."""
        self.log_request(status, len(body))
        reason = self.responses.get(status, ("",))[0]
        head = (
            f"{self.protocol_version} {status} {reason}\r\n"
            f"Server: {self.version_string()}\r\n"
            f"Date: {self.date_time_string()}\r\n"
            f"content-type: {ctype}\r\n"
            f"content-length: {len(body)}\r\n"
            "x-upstream: fake\r\n\r\n"
        )
        self.wfile.write(head.encode("latin-1") + body)

    def do_GET(self) -> None:
        self._dispatch(b"")

    def do_DELETE(self) -> None:
        self._dispatch(self._body())

    def do_PUT(self) -> None:
        self._dispatch(self._body())

    def do_POST(self) -> None:
        self._dispatch(self._body())

    def _dispatch(self, body: bytes) -> None:
        up = self.upstream
        parts = urlsplit(self.path)
        up.calls[parts.path] += 1
        up.seen_headers.append({k.lower(): v for k, v in self.headers.items()})
        if parts.path not in ("/_stats", "/_control") and up.take("drop_next"):
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if parts.path == "/_stats":
            self._send(200, json.dumps({"calls": dict(up.calls)}).encode())
            return
        if parts.path == "/_control":
            up.control(json.loads(body or b"{}"))
            self._send(200, b'{"ok": true}')
            return
        if self.command == "POST" and parts.path in {
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/embeddings",
        }:
            self._openai(parts.path, body)
            return
        status = int(parse_qs(parts.query).get("status", ["200"])[0])
        echo = {
            "method": self.command,
            "path": self.path,
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": body.decode("utf-8", "replace"),
        }
        self._send(status, json.dumps(echo).encode())

    def _openai(self, path: str, body: bytes) -> None:
        up = self.upstream
        tenant = self.headers.get("x-tenant-id", "")
        delay = up.latency_s.get(tenant, up.default_latency_s)
        if delay > 0:
            time.sleep(delay)
        if up.take("fail_next"):
            self._send(int(up.fail_status), b'{"error": {"message": "injected failure"}}')
            return
        try:
            request = json.loads(body)
        except ValueError:
            self._send(400, b'{"error": {"message": "invalid JSON"}}')
            return
        number = up.next_number()
        digest = hashlib.sha256(body).hexdigest()[:12]
        if up.take("invalid_json_next"):
            self._send(200, b"this is not json")
            return
        if up.take("error_object_next"):
            self._send(200, b'{"error": {"message": "model overloaded", "type": "server_error"}}')
            return
        if up.take("truncate_next"):
            payload = b'{"id": "trunc", "choices": ['
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload) + 100))
            self.end_headers()
            self.wfile.write(payload)
            self.wfile.flush()
            self.close_connection = True
            return
        if isinstance(request, dict) and request.get("stream") is True:
            self._stream(
                request,
                number,
                digest,
                broken=up.take("break_stream_next"),
                error=up.take("sse_error_next"),
                done=not up.take("sse_no_done_next"),
            )
            return
        model = request.get("model", "") if isinstance(request, dict) else ""
        if path == "/v1/embeddings":
            inputs = request.get("input") if isinstance(request, dict) else None
            texts = [inputs] if isinstance(inputs, str) else inputs
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                self._send(400, b'{"error": {"message": "input must be text"}}')
                return
            answer: dict[str, Any] = {
                "object": "list",
                "data": [
                    {"object": "embedding", "index": i, "embedding": embed(text)}
                    for i, text in enumerate(texts)
                ],
                "model": model,
                "id": f"emb-{number}",
            }
        else:
            text = f"answer {digest} #{number}"
            messages = request.get("messages") if isinstance(request, dict) else None
            if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
                text = up.fixed_answers.get(str(messages[-1].get("content")), text)
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if path == "/v1/chat/completions"
                else {"index": 0, "text": text}
            )
            choice["finish_reason"] = "stop"
            answer = {
                "id": f"cmpl-{number}",
                "object": "chat.completion",
                "model": model,
                "choices": [choice],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            }
        if up.pad_bytes:
            answer["padding"] = "x" * int(up.pad_bytes)
        self._send(200, json.dumps(answer).encode())

    def _stream(
        self,
        request: dict[str, Any],
        number: int,
        digest: str,
        *,
        broken: bool,
        error: bool = False,
        done: bool = True,
    ) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        words = ["answer", digest, f"#{number}"]
        gap = float(self.upstream.event_gap_s)
        for i, word in enumerate(words):
            if i and gap > 0:
                time.sleep(gap)
            event = {
                "id": f"chunk-{number}",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": word + " "}}],
            }
            data = f"data: {json.dumps(event)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            if broken and i == 1:
                self.close_connection = True
                self.connection.shutdown(2)
                return
        if error:
            failure = (
                b'data: {"error": {"message": "generation failed", "type": "server_error"}}\n\n'
            )
            self.wfile.write(b"%x\r\n%s\r\n" % (len(failure), failure))
        options = request.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            # as OpenAI does: a last chunk with no choices and the whole answer's usage
            last = {
                "id": f"chunk-{number}",
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            }
            data = f"data: {json.dumps(last)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        end = b"data: [DONE]\n\n" if done else b""
        if end:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(end), end))
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fake-upstream")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    upstream = FakeUpstream(port=args.port)
    print(f"fake upstream on {upstream.url}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        upstream.server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
