"""Local service launchers: Redis (standalone and cluster) and Prometheus.

Used by the test fixtures and by ``cachefleet demo``. Every launcher is a
context manager that picks free loopback ports, starts the real binary with
its data in a private temporary directory, waits (bounded) until the service
answers, and on exit kills the process and removes the directory.

A missing binary raises :class:`ServiceBinaryMissing` with the hint
``make deps``; a service that does not come up raises :class:`ServiceError`
carrying the tail of its log.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

LOOPBACK = "127.0.0.1"

#: How long a Redis server may take to answer PING after start, seconds.
REDIS_START_TIMEOUT_S = 10.0
#: How long ``redis-cli --cluster create`` plus ``cluster_state:ok`` may take.
CLUSTER_FORM_TIMEOUT_S = 30.0
#: How long Prometheus may take to report ready, seconds.
PROMETHEUS_START_TIMEOUT_S = 20.0
#: How long a killed process may take to exit, seconds.
STOP_TIMEOUT_S = 5.0
#: Socket timeout of the readiness probes, seconds.
PROBE_TIMEOUT_S = 0.5
#: Pause between readiness probes, seconds.
POLL_INTERVAL_S = 0.02
#: How many times a launcher retries with fresh ports if the port was taken.
PORT_ATTEMPTS = 5
#: Bytes of a service log quoted in error messages.
LOG_TAIL_BYTES = 2000


class ServiceError(RuntimeError):
    """A local service could not be started or driven."""


class ServiceBinaryMissing(ServiceError):
    """The service's binary is not installed."""


def find_binary(name: str) -> str:
    """Absolute path of ``name`` on PATH or in /usr/sbin, or ServiceBinaryMissing."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if found is None:
        raise ServiceBinaryMissing(f"{name} not found: install {_package_of(name)}: make deps")
    return found


def _package_of(binary: str) -> str:
    return {"redis-cli": "redis-server", "promtool": "prometheus"}.get(binary, binary)


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def _log_tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-LOG_TAIL_BYTES:].decode(errors="replace")


def _terminate(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_TIMEOUT_S)


def redis_command(port: int, *args: str, timeout_s: float = PROBE_TIMEOUT_S) -> bytes:
    """Send one RESP command to a loopback Redis and return the raw reply.

    Deliberately dependency-free (no redis-py) so the launchers work before
    anything else is importable. Reads until the reply looks complete for the
    simple replies the launchers need (status, error, integer, bulk string).
    """
    payload = f"*{len(args)}\r\n".encode()
    for arg in args:
        raw = arg.encode()
        payload += b"$%d\r\n%s\r\n" % (len(raw), raw)
    with socket.create_connection((LOOPBACK, port), timeout=timeout_s) as sock:
        sock.sendall(payload)
        reply = b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
            if _resp_complete(reply):
                break
        return reply


def _resp_complete(reply: bytes) -> bool:
    if not reply.endswith(b"\r\n"):
        return False
    if reply[:1] != b"$":
        return True
    header, _, rest = reply.partition(b"\r\n")
    length = int(header[1:])
    return length < 0 or len(rest) >= length + 2


class RedisServer:
    """One ``redis-server`` on loopback, no persistence.

    ``extra_args`` are appended to the command line (the cluster launcher uses
    it). :meth:`kill` / :meth:`restart` stop and start the process on the same
    port (a fault: data is lost); :meth:`pause` / :meth:`resume` freeze it with
    SIGSTOP / SIGCONT (connections hang instead of being refused).
    """

    def __init__(self, *, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        self._binary = find_binary("redis-server")
        self._fixed_port = port
        self._port = port or 0
        self._extra = list(extra_args)
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    # ------------------------------------------------------------ properties

    @property
    def host(self) -> str:
        return LOOPBACK

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self._port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def workdir(self) -> Path:
        if self._dir is None:
            raise ServiceError("redis-server not started")
        return self._dir

    # ------------------------------------------------------------- lifecycle

    def start(self) -> Self:
        """Start the server (fresh ports unless one was given) and wait for PING."""
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="cachefleet-redis-"))
        last_error: ServiceError | None = None
        for _ in range(PORT_ATTEMPTS if self._fixed_port is None else 1):
            if self._fixed_port is None:
                self._port = free_port()
            try:
                self._launch()
                return self
            except ServiceBinaryMissing:
                raise
            except ServiceError as exc:
                last_error = exc
        assert last_error is not None
        self.stop()
        raise last_error

    def _command(self) -> list[str]:
        return [
            self._binary,
            "--port",
            str(self._port),
            "--bind",
            LOOPBACK,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            *self._extra,
        ]

    def _launch(self) -> None:
        log = self.workdir / f"redis-{self._port}.log"
        with log.open("ab") as sink:
            self._proc = subprocess.Popen(
                self._command(), stdout=sink, stderr=subprocess.STDOUT, cwd=self.workdir
            )
        self._paused = False
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServiceError(f"redis-server on port {self._port} exited: {_log_tail(log)}")
            with contextlib.suppress(OSError):
                if redis_command(self._port, "PING").startswith(b"+PONG"):
                    return
            time.sleep(POLL_INTERVAL_S)
        _terminate(self._proc)
        raise ServiceError(f"redis-server on port {self._port} did not answer: {_log_tail(log)}")

    def kill(self) -> None:
        """Kill the process (SIGKILL); the port and the work directory stay."""
        if self._paused:
            self.resume()
        _terminate(self._proc)
        self._proc = None

    def restart(self) -> None:
        """Kill (if running) and start again on the same port."""
        self.kill()
        self._launch()

    def pause(self) -> None:
        """Freeze the server with SIGSTOP: clients connect but get no answer."""
        if self._proc is not None and not self._paused:
            self._proc.send_signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        if self._proc is not None and self._paused:
            self._proc.send_signal(signal.SIGCONT)
            self._paused = False

    def flushall(self) -> None:
        """Drop every key (used by the per-test fixtures)."""
        reply = redis_command(self._port, "FLUSHALL")
        if not reply.startswith(b"+OK"):
            raise ServiceError(f"FLUSHALL on port {self._port} failed: {reply!r}")

    def stop(self) -> None:
        """Kill the process and remove the work directory."""
        self.kill()
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


class RedisCluster:
    """A Redis Cluster of ``nodes`` primaries (no replicas) on loopback.

    ``url`` is the cluster URL understood by
    :func:`cachefleet_common.contract.clients.redis_from_url`
    (``redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...``); ``urls`` are the
    plain per-node URLs.
    """

    def __init__(self, nodes: int = 3) -> None:
        if nodes < 3:
            raise ValueError("Redis Cluster needs at least 3 primaries")
        self._count = nodes
        self._cli = find_binary("redis-cli")
        find_binary("redis-server")
        self.nodes: list[RedisServer] = []

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def urls(self) -> list[str]:
        return [f"redis://{LOOPBACK}:{port}" for port in self.ports]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{LOOPBACK}:{port}" for port in self.ports)

    def start(self) -> Self:
        try:
            for _ in range(self._count):
                bus_port = free_port()
                node = RedisServer(
                    extra_args=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-port",
                        str(bus_port),
                        "--cluster-node-timeout",
                        "2000",
                    ]
                )
                self.nodes.append(node)
                node.start()
            self._create()
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self) -> None:
        command = [
            self._cli,
            "--cluster",
            "create",
            *(f"{LOOPBACK}:{port}" for port in self.ports),
            "--cluster-replicas",
            "0",
            "--cluster-yes",
        ]
        try:
            done = subprocess.run(
                command, capture_output=True, timeout=CLUSTER_FORM_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise ServiceError("redis-cli --cluster create timed out") from exc
        if done.returncode != 0:
            raise ServiceError(
                "redis-cli --cluster create failed: "
                + (done.stdout + done.stderr)[-LOG_TAIL_BYTES:].decode(errors="replace")
            )
        deadline = time.monotonic() + CLUSTER_FORM_TIMEOUT_S
        while time.monotonic() < deadline:
            if all(self._node_ok(port) for port in self.ports):
                return
            time.sleep(POLL_INTERVAL_S * 5)
        raise ServiceError("Redis Cluster did not reach cluster_state:ok")

    def _node_ok(self, port: int) -> bool:
        try:
            info = redis_command(port, "CLUSTER", "INFO")
        except OSError:
            return False
        return b"cluster_state:ok" in info and b"cluster_slots_assigned:16384" in info

    def flushall(self) -> None:
        for node in self.nodes:
            node.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes = []

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class PrometheusServer:
    """A Prometheus server on loopback scraping static targets.

    ``scrape_targets`` maps a job name to ``host:port`` targets. The server
    runs with ``--web.enable-lifecycle`` so :meth:`reload` can swap the
    targets without a restart. Note that Prometheus refreshes target
    discovery about every 5 s, so the first samples arrive a few seconds
    after start or reload.
    """

    def __init__(
        self,
        scrape_targets: Mapping[str, Sequence[str]],
        scrape_interval_s: float = 1.0,
    ) -> None:
        self._binary = find_binary("prometheus")
        self._targets = {job: list(t) for job, t in scrape_targets.items()}
        self._interval_s = scrape_interval_s
        self._port = 0
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self._port}"

    @property
    def config_path(self) -> Path:
        if self._dir is None:
            raise ServiceError("prometheus not started")
        return self._dir / "prometheus.yml"

    def config(self) -> dict[str, object]:
        """The configuration in force (JSON is valid YAML, so it is written as JSON)."""
        interval = f"{max(1, round(self._interval_s * 1000))}ms"
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {
                    "job_name": job,
                    "scrape_interval": interval,
                    "static_configs": [{"targets": targets}],
                }
                for job, targets in self._targets.items()
            ],
        }

    def _write_config(self) -> None:
        self.config_path.write_text(json.dumps(self.config(), indent=2))

    def start(self) -> Self:
        self._dir = Path(tempfile.mkdtemp(prefix="cachefleet-prometheus-"))
        self._write_config()
        last_error: ServiceError | None = None
        for _ in range(PORT_ATTEMPTS):
            self._port = free_port()
            try:
                self._launch()
                return self
            except ServiceError as exc:
                last_error = exc
        self.stop()
        assert last_error is not None
        raise last_error

    def _launch(self) -> None:
        assert self._dir is not None
        log = self._dir / "prometheus.log"
        command = [
            self._binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self._dir / 'data'}",
            f"--web.listen-address={LOOPBACK}:{self._port}",
            "--web.enable-lifecycle",
            "--log.level=warn",
        ]
        with log.open("ab") as sink:
            self._proc = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, cwd=self._dir
            )
        deadline = time.monotonic() + PROMETHEUS_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServiceError(f"prometheus exited: {_log_tail(log)}")
            if self._http("GET", "/-/ready") == 200:
                return
            time.sleep(POLL_INTERVAL_S * 5)
        _terminate(self._proc)
        raise ServiceError(f"prometheus did not become ready: {_log_tail(log)}")

    def _http(self, method: str, path: str) -> int | None:
        request = urllib.request.Request(self.url + path, method=method)
        try:
            with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S * 4) as response:
                status: int = response.status
                return status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None

    def reload(self, scrape_targets: Mapping[str, Sequence[str]]) -> None:
        """Replace every job's targets and make Prometheus reload its config."""
        self._targets = {job: list(t) for job, t in scrape_targets.items()}
        self._write_config()
        status = self._http("POST", "/-/reload")
        if status != 200:
            raise ServiceError(f"prometheus reload answered {status}")

    def stop(self) -> None:
        _terminate(self._proc)
        self._proc = None
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


__all__ = [
    "LOOPBACK",
    "PrometheusServer",
    "RedisCluster",
    "RedisServer",
    "ServiceBinaryMissing",
    "ServiceError",
    "find_binary",
    "free_port",
    "redis_command",
]
