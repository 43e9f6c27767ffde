"""The servers under test of ``cachefleet bench proxy``, each in its own process group.

The responder (bare, answering from Redis, or relaying bytes), nginx
``proxy_cache``, redis-server and ``cachefleet sidecar`` in its configurations,
started on demand on free loopback ports and all stopped on close; their
output goes to log files whose ends the report quotes when a check fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from cachefleet_bench.proxy_load import HOST, POLL_INTERVAL_S, BenchError
from cachefleet_bench.responder import CHAT_COMPLETION_BODY
from cachefleet_e2e.services import RedisServer, ServiceError, redis_command

#: L1 size of the sidecar in the ``l1`` and ``miss`` rows.
SIDECAR_L1_BYTES = 64 * 1024 * 1024
#: How long a started service may take to accept connections.
SERVICE_START_TIMEOUT_S = 20.0
#: How long a service gets between SIGTERM and SIGKILL.
STOP_TIMEOUT_S = 5.0

#: Where nginx keeps its proxy_cache when it is a writable tmpfs: its miss then writes
#: to memory, as a tuned nginx would, and its miss overhead does not follow the disk.
MEMORY_FS = "/dev/shm"

#: The Redis key the ``floor-l2`` responder reads (holds the upstream's answer).
FLOOR_REDIS_KEY = "cachefleet-bench:floor"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


class ManagedProcess:
    """A child process in its own process group, with its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, **popen: Any) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **popen,
            )
        except BaseException:
            self._log.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, limit: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:].strip()
        except OSError:
            return ""

    def wait_for_port(self, port: int, timeout_s: float = SERVICE_START_TIMEOUT_S) -> None:
        """Wait until ``port`` accepts connections; fail early if the process dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise BenchError(
                    f"{self.name} exited with code {code} before listening; "
                    f"its output:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.2):
                return
            time.sleep(POLL_INTERVAL_S)
        raise BenchError(
            f"{self.name} did not listen on {HOST}:{port} within {timeout_s:g} s; "
            f"its output:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after :data:`STOP_TIMEOUT_S`."""
        try:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(STOP_TIMEOUT_S)
            # Leftovers of the group (e.g. nginx workers) go too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        finally:
            self._log.close()


def _nginx_conf(prefix: Path, port: int, upstream_port: int, cache: Path) -> str:
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""{user}worker_processes 1;
daemon off;
master_process on;
pid {prefix}/nginx.pid;
error_log {prefix}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy-temp;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    proxy_cache_path {cache} levels=1:2 keys_zone=cf:16m max_size=256m
                     inactive=60m use_temp_path=off;
    upstream responder {{
        server {HOST}:{upstream_port};
        keepalive 64;
    }}
    server {{
        listen {HOST}:{port} backlog=1024;
        # The cache key is the body, so the body must be in memory.
        client_body_buffer_size 64k;
        client_max_body_size 64k;
        location / {{
            proxy_pass http://responder;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_cache cf;
            proxy_cache_methods POST;
            proxy_cache_key "$request_body";
            proxy_cache_valid 200 60m;
            add_header X-Cache $upstream_cache_status;
        }}
    }}
}}
"""


def _clean_env() -> dict[str, str]:
    """The environment for children: without CACHEFLEET_* settings of the caller."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CACHEFLEET_")}


class Services:
    """Starts the benchmark's services on demand and stops them all on close."""

    def __init__(self, workdir: Path, progress: Callable[[str], None]) -> None:
        self.workdir = workdir
        self.progress = progress
        self._stack = contextlib.ExitStack()
        self._ports: dict[str, int] = {}
        self._pids: dict[str, int] = {}
        self._procs: dict[str, ManagedProcess] = {}
        self._failures: dict[str, BenchError] = {}

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, name: str, argv: Sequence[str], port: int, **popen: Any) -> None:
        proc = ManagedProcess(name, argv, self.workdir, **popen)
        self._stack.callback(proc.stop)
        proc.wait_for_port(port)
        self._ports[name], self._pids[name], self._procs[name] = port, proc.pid, proc

    def _get(self, name: str, starter: Callable[[], None]) -> int:
        """The port of service ``name``, started by ``starter`` the first time."""
        if name in self._failures:
            raise self._failures[name]
        if name not in self._ports:
            try:
                starter()
            except BenchError as exc:
                self._failures[name] = exc
                raise
        return self._ports[name]

    def pid(self, name: str) -> int:
        return self._pids[name]

    def _memory_dir(self, name: str) -> Path | None:
        """A fresh directory on a tmpfs (removed on close), or None when there is none."""
        if not os.access(MEMORY_FS, os.W_OK):
            return None
        path = Path(tempfile.mkdtemp(prefix=f"cachefleet-bench-{name}-", dir=MEMORY_FS))
        self._stack.callback(shutil.rmtree, path, True)
        return path

    def log_tail(self, name: str, limit: int = 1200) -> str:
        """The end of a started service's output ('' if it never started)."""
        proc = self._procs.get(name)
        return proc.log_tail(limit) if proc is not None else ""

    def _start_responder(self, name: str, what: str, extra: Sequence[str] = ()) -> None:
        """Start ``cachefleet_bench.responder`` (``extra``: its flags) as service ``name``."""
        port = free_port()
        argv = [sys.executable, "-m", "cachefleet_bench.responder", "--port", str(port), *extra]
        self.progress(f"starting {what} on {HOST}:{port}")
        self._start(name, argv, port, env=_clean_env())

    def responder(self) -> int:
        return self._get("responder", lambda: self._start_responder("responder", "the responder"))

    def responder_redis(self) -> int:
        """The responder answering from Redis, one GET per request: the L2 hit's floor."""

        def start() -> None:
            redis = self.redis()
            body = CHAT_COMPLETION_BODY.decode()
            reply = redis_command(redis, "SET", FLOOR_REDIS_KEY, body)
            if reply != b"+OK\r\n":
                raise BenchError(f"redis SET {FLOOR_REDIS_KEY} answered {reply[:100]!r}")
            extra = ["--redis-port", str(redis), "--redis-key", FLOOR_REDIS_KEY]
            what = "the responder with one Redis GET per request"
            self._start_responder("responder-redis", what, extra)

        return self._get("responder-redis", start)

    def relay(self) -> int:
        """The responder relaying bytes to the responder: a proxied miss's floor."""

        def start() -> None:
            extra = ["--relay-port", str(self.responder())]
            self._start_responder("relay", "the byte relay to the responder", extra)

        return self._get("relay", start)

    def nginx(self) -> int:
        def start() -> None:
            binary = shutil.which("nginx") or (
                "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
            )
            if binary is None:
                raise BenchError("nginx is not installed (Debian package 'nginx-light')")
            upstream = self.responder()
            prefix = self.workdir / "nginx"
            prefix.mkdir()
            port = free_port()
            cache = self._memory_dir("nginx-cache") or prefix / "cache"
            conf = prefix / "nginx.conf"
            conf.write_text(_nginx_conf(prefix, port, upstream, cache))
            self.progress(f"starting nginx (1 worker, proxy_cache in {cache}) on {HOST}:{port}")
            argv = [binary, "-p", str(prefix), "-e", str(prefix / "nginx-error.log"), "-c"]
            self._start("nginx", [*argv, str(conf)], port)

        return self._get("nginx", start)

    def redis(self) -> int:
        """A redis-server for the L2 row (the e2e launcher; its pid from INFO)."""

        def start() -> None:
            try:
                server = RedisServer().start()
            except ServiceError as exc:
                raise BenchError(f"redis-server did not start: {exc}") from exc
            self._stack.callback(server.stop)
            self.progress(f"started redis-server on {server.host}:{server.port}")
            info = redis_command(server.port, "INFO", "server").decode(errors="replace")
            pid = next(
                (
                    int(line.split(":", 1)[1])
                    for line in info.splitlines()
                    if line.startswith("process_id:")
                ),
                None,
            )
            if pid is None:
                raise BenchError(f"redis INFO named no process_id: {info[:200]!r}")
            self._ports["redis"], self._pids["redis"] = server.port, pid

        return self._get("redis", start)

    def sidecar(self, name: str, l1_bytes: int, with_redis: bool, extra: Sequence[str] = ()) -> int:
        """A ``cachefleet sidecar`` in front of the responder (``extra``: more flags)."""

        def start() -> None:
            upstream = self.responder()
            port = free_port()
            argv = [sys.executable, "-m", "cachefleet_operator.cli", "sidecar"]
            argv += ["--listen", f"{HOST}:{port}", "--upstream", f"http://{HOST}:{upstream}"]
            argv += ["--admin-listen", f"{HOST}:{free_port()}"]
            argv += ["--trusted-proxies", f"{HOST}/32"]  # wrk names the tenant by header
            argv += ["--l1-bytes", str(l1_bytes)]
            if with_redis:
                argv += ["--redis-url", f"redis://{HOST}:{self.redis()}/0"]
            argv += list(extra)
            self.progress(f"starting {name}: cachefleet {' '.join(argv[3:])}")
            try:
                self._start(name, argv, port, env=_clean_env())
            except BenchError as exc:
                raise BenchError(f"the sidecar is not runnable: {exc}") from exc

        return self._get(name, start)
