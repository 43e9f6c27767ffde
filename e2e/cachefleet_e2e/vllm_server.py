"""Real vLLM servers on loopback, serving the tiny locally built model: the `vllm` tier's launcher.

vLLM runs from its own venv (``.venv-vllm``, ``make vllm-env``; another interpreter with
``CACHEFLEET_VLLM_PYTHON``), never imported here: this module only builds command lines,
starts processes and probes them over HTTP, so it works from the project's venv.

* :func:`vllm_python` finds that interpreter, or raises :class:`VllmUnavailable` saying
  how to get one (the test tier turns that into a skip);
* :func:`tiny_model` builds (or reuses, by content hash) the tiny Llama with
  ``scripts/tinymodel.py``;
* :class:`VllmServer` is one ``vllm.entrypoints.launchers.api_server.entry`` process on a
  free loopback port, with prefix caching and ZMQ KV events on a second free port;
  :meth:`VllmServer.launch` returns at once and :meth:`VllmServer.wait_ready` waits for
  ``/health``, so several servers start side by side. :meth:`VllmServer.stop` sends
  SIGTERM (vLLM exits in well under a second), then SIGKILL after
  :data:`VLLM_STOP_TIMEOUT_S`.

The flags and environment are the ones docs/testing.md explains (eager mode, one engine
process, offline, a kept compile cache, the dev-mode endpoints such as
``/reset_prefix_cache``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from cachefleet_e2e.services import LOOPBACK, ServiceError, free_port

#: The repository's root (scripts/, .venv-vllm/ and .cache/ live there).
REPO_ROOT = Path(__file__).resolve().parents[2]
#: vLLM's interpreter unless CACHEFLEET_VLLM_PYTHON names another.
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
VLLM_PYTHON_ENV = "CACHEFLEET_VLLM_PYTHON"
#: Kept between runs: the tiny model and vLLM's own cache (6 s less per start).
CACHE_DIR = REPO_ROOT / ".cache"
TINY_MODEL_SCRIPT = REPO_ROOT / "scripts" / "tinymodel.py"
#: The name the servers give the tiny model (``model`` in requests, ``/v1/models``).
SERVED_MODEL = "tiny"
#: Generous: 14 s on an idle 2-core machine, several at once on a loaded one take longer.
VLLM_START_TIMEOUT_S = 300.0
#: Building the tiny model: ~5 s idle.
TINY_MODEL_TIMEOUT_S = 300.0
#: Launches of a server whose process exits while starting (see :func:`start_all`).
START_ATTEMPTS = 2
#: SIGTERM, then SIGKILL after this many seconds.
VLLM_STOP_TIMEOUT_S = 20.0
#: Socket timeout of one readiness probe, seconds.
PROBE_TIMEOUT_S = 2.0
#: Pause between readiness probes, seconds.
POLL_INTERVAL_S = 0.25
#: Bytes of a server's log quoted in error messages, after up to ERROR_LINES error lines.
LOG_TAIL_BYTES = 4000
ERROR_LINES = 20
#: vLLM's KV-cache block, tokens (the CPU attention backend wants a multiple of 32).
DEFAULT_BLOCK_SIZE = 32
DEFAULT_MAX_MODEL_LEN = 1024
#: 16 MiB: ~32 k tokens of the tiny model (0.5 KiB per token in bfloat16).
DEFAULT_KV_CACHE_BYTES = 16 * 1024 * 1024
#: The topic vLLM publishes KV events under.
KV_EVENTS_TOPIC = "kv-events"


class VllmUnavailable(ServiceError):
    """vLLM's interpreter is missing (``make vllm-env`` installs it)."""


def vllm_python() -> Path:
    """vLLM's interpreter: $CACHEFLEET_VLLM_PYTHON or .venv-vllm/bin/python, checked."""
    configured = os.environ.get(VLLM_PYTHON_ENV)
    python = Path(configured) if configured else DEFAULT_VLLM_PYTHON
    if not python.is_file() or not os.access(python, os.X_OK):
        where = f"${VLLM_PYTHON_ENV}={configured}" if configured else str(DEFAULT_VLLM_PYTHON)
        raise VllmUnavailable(f"no vLLM interpreter at {where}: run `make vllm-env`")
    return python


@dataclass(frozen=True)
class TinyModel:
    """A built tiny model: its directory and its content digest (sha256 of its files)."""

    path: Path
    digest: str
    built: bool
    seconds: float


def tiny_model(python: Path | None = None, out: Path | None = None) -> TinyModel:
    """Build the tiny Llama into ``out`` (default .cache/tinymodel), or reuse it there."""
    python = python or vllm_python()
    out = out or CACHE_DIR / "tinymodel"
    done = subprocess.run(
        [str(python), str(TINY_MODEL_SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=TINY_MODEL_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise ServiceError(f"building the tiny model failed: {done.stderr[-LOG_TAIL_BYTES:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return TinyModel(
        path=Path(report["path"]),
        digest=str(report["digest"]),
        built=bool(report["built"]),
        seconds=float(report["seconds"]),
    )


def _get(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class VllmServer:
    """One real vLLM server on loopback serving ``model`` as :data:`SERVED_MODEL`.

    ``kv_cache_bytes`` sizes the KV cache; ``num_blocks`` fixes the number of blocks within
    it (small values force evictions: it must hold ``max_model_len`` plus one block; the
    bytes must hold the blocks, about 16 KiB per block of the tiny model).
    ``kv_events`` publishes KV-cache events over ZMQ, bound on :attr:`kv_events_port`
    (``tcp://*:PORT``: vLLM binds; subscribers connect to :attr:`kv_events_endpoint`).
    """

    def __init__(
        self,
        model: Path,
        *,
        python: Path | None = None,
        name: str = "vllm",
        served_model: str = SERVED_MODEL,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        num_blocks: int | None = None,
        kv_events: bool = True,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        cache_root: Path | None = None,
    ) -> None:
        self.model = model
        self.python = python or vllm_python()
        self.name = name
        self.served_model = served_model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_cache_bytes = kv_cache_bytes
        self.num_blocks = num_blocks
        self.kv_events = kv_events
        self._extra = list(extra_args)
        self._extra_env = dict(extra_env or {})
        self.cache_root = cache_root or CACHE_DIR / "vllm-root"
        self.port = 0
        self.kv_events_port = 0
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        #: Seconds from launch to the first healthy answer (set by wait_ready).
        self.start_s: float | None = None
        #: Why earlier launches failed (start_all relaunches once).
        self.failures: list[str] = []
        #: The last wait_ready saw the process exit (not a timeout).
        self.exited = False

    # ------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        """Where a subscriber connects (vLLM binds ``tcp://*:PORT``)."""
        return f"tcp://{LOOPBACK}:{self.kv_events_port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        if self._dir is None:
            raise ServiceError(f"{self.name} not started")
        return self._dir / "vllm.log"

    def log_tail(self) -> str:
        """The log's error lines (the root cause is often far above the end), then its end."""
        try:
            data = self.log_path.read_bytes().decode(errors="replace")
        except (OSError, ServiceError):
            return "(no log)"
        errors = [line for line in data.splitlines() if "Error" in line or "ERROR" in line]
        head = "\n".join(errors[:ERROR_LINES])
        return (head + "\n...\n" if head else "") + data[-LOG_TAIL_BYTES:]

    # ------------------------------------------------------------- lifecycle

    def command(self) -> list[str]:
        args = [
            str(self.python),
            "-m",
            "vllm.entrypoints.launchers.api_server.entry",
            "--model",
            str(self.model),
            "--served-model-name",
            self.served_model,
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            "--enforce-eager",
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching",
            "--seed",
            "0",
        ]
        # Always an explicit KV size: without it vLLM's CPU backend first checks that
        # --gpu-memory-utilization (0.92) of the machine's memory is free, and fails to
        # start whenever other processes hold more than 8 % of it. The block override,
        # when given, then sets the number of blocks within that size.
        args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.num_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.kv_events:
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.kv_events_port}",
                "topic": KV_EVENTS_TOPIC,
            }
            args += ["--kv-events-config", json.dumps(config)]
        return args + self._extra

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The project's venv must not leak into vLLM's interpreter.
        for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(name, None)
        env.update(
            {
                # Measured faster to start (14 s to /health instead of 20 s; TESTING.md).
                # The API server still runs its engine core in a child process.
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_HOST_IP": LOOPBACK,
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                # /reset_prefix_cache and the other dev endpoints.
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_CACHE_ROOT": str(self.cache_root),
                "VLLM_LOGGING_LEVEL": "INFO",
            }
        )
        env.update(self._extra_env)
        return env

    def launch(self) -> Self:
        """Start the process on fresh free ports; returns at once (see :meth:`wait_ready`)."""
        if self.running:
            return self
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix=f"cachefleet-{self.name}-"))
        self.cache_root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.kv_events_port = free_port()
        while self.kv_events_port == self.port:
            self.kv_events_port = free_port()
        with self.log_path.open("ab") as sink:
            self._proc = subprocess.Popen(
                self.command(),
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self._dir,
                env=self.environment(),
                start_new_session=True,
            )
        self.started_at = time.monotonic()
        self.start_s = None
        self.exited = False
        return self

    def wait_ready(self, timeout_s: float = VLLM_START_TIMEOUT_S) -> Self:
        """Wait (bounded) until ``/health`` answers 200; a dead process fails at once."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is None:
                raise ServiceError(f"{self.name} not launched")
            if self._proc.poll() is not None:
                self.exited = True
                raise ServiceError(
                    f"{self.name} (vLLM on port {self.port}) exited with "
                    f"{self._proc.returncode}: {self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                status, _ = _get(f"{self.url}/health")
                if status == 200:
                    self.start_s = time.monotonic() - self.started_at
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise ServiceError(
                    f"{self.name} (vLLM on port {self.port}) not healthy after {timeout_s:.0f} s: "
                    f"{self.log_tail()}"
                )
            time.sleep(POLL_INTERVAL_S)

    def start(self, timeout_s: float = VLLM_START_TIMEOUT_S) -> Self:
        return self.launch().wait_ready(timeout_s)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after :data:`VLLM_STOP_TIMEOUT_S`; the log directory goes."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=VLLM_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=VLLM_STOP_TIMEOUT_S)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_all(
    servers: Sequence[VllmServer],
    timeout_s: float = VLLM_START_TIMEOUT_S,
    *,
    attempts: int = START_ATTEMPTS,
) -> None:
    """Launch every server, then wait for all (they start side by side).

    A server whose process exits while starting is launched again on fresh ports, up to
    ``attempts`` launches in all (a start can fail for reasons of the moment: a port taken
    between :func:`free_port` and vLLM's bind, the machine's free memory); one that is still
    not healthy after ``timeout_s`` is not.
    On failure every server is stopped and the last error raised.
    """
    try:
        for server in servers:
            server.launch()
        for server in servers:
            for attempt in range(1, attempts + 1):
                try:
                    server.wait_ready(timeout_s)
                    break
                except ServiceError as exc:
                    server.failures.append(str(exc))
                    if attempt == attempts or not server.exited:
                        raise
                    server.stop()
                    server.launch()
    except BaseException:
        for server in servers:
            server.stop()
        raise
