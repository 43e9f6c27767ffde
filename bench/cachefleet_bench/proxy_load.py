"""The load driver of ``cachefleet bench proxy``: the requests, wrk, and what is counted.

The rows' requests (one deterministic chat request, or unique ones made by a
counter in wrk's Lua script), one wrk run with its own CPU time (``wait4``),
the line its ``done`` hook prints, one plain POST for the functional checks,
and the CPU seconds of a process tree and the machine's context switches
sampled around a run (``/proc``).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
#: The path every row requests.
REQUEST_PATH = "/v1/chat/completions"
#: Tenant header and value the sidecar rows send.
TENANT_HEADER = "X-Tenant-ID"
TENANT = "bench"

#: wrk runs with one thread: the load generator takes one of the (few) cores.
WRK_THREADS = 1
#: wrk's per-request timeout; a request slower than this counts as an error.
WRK_REQUEST_TIMEOUT_S = 5
#: How long wrk may run past its ``-d`` before it is killed.
WRK_GRACE_S = 15.0
#: Timeout of the functional checks (single HTTP requests) before a row.
CHECK_TIMEOUT_S = 5.0
#: Pause between tries while waiting for a service or a warm cache.
POLL_INTERVAL_S = 0.05

#: The deterministic chat request of the hit rows (``temperature`` 0).
CHAT_REQUEST: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Explain in two sentences what an inference cache does."},
    ],
    "temperature": 0,
    "max_tokens": 128,
}

#: Marker of the line the wrk Lua ``done`` hook prints.
WRK_RESULT_MARK = "CFBENCH"


def hit_body() -> bytes:
    """The body of the deterministic hit request (compact JSON)."""
    return json.dumps(CHAT_REQUEST, separators=(",", ":")).encode()


def unique_body(nonce: str, counter: int) -> bytes:
    """The ``counter``-th unique request of run ``nonce`` (what the Lua script sends)."""
    request = json.loads(hit_body())
    request["messages"][1]["content"] += f" [{nonce}-{counter}]"
    return json.dumps(request, separators=(",", ":")).encode()


def _lua_long_string(text: str) -> str:
    """``text`` as a Lua long-bracket literal that cannot be closed early."""
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    eq = "=" * level
    return f"[{eq}[{text}]{eq}]"


def render_wrk_script(*, unique: bool, nonce: str, tenant: bool) -> str:
    """The wrk Lua script: POST :data:`REQUEST_PATH`, and a ``done`` hook that
    prints one machine-readable result line.

    With ``unique`` every request carries a body made unique by a counter (and
    ``nonce``, so that two runs never repeat each other's bodies); otherwise
    wrk sends one pre-built request over and over (its fastest mode).
    """
    lines = [
        'wrk.method = "POST"',
        f'wrk.path = "{REQUEST_PATH}"',
        'wrk.headers["Content-Type"] = "application/json"',
    ]
    if tenant:
        lines.append(f'wrk.headers["{TENANT_HEADER}"] = "{TENANT}"')
    if unique:
        marker = "@@COUNTER@@"
        template = unique_body(nonce, 0).decode().replace("-0]", f"-{marker}]")
        head, tail = template.split(marker)
        lines += [
            f"local head = {_lua_long_string(head)}",
            f"local tail = {_lua_long_string(tail)}",
            "local counter = 0",
            "request = function()",
            "  counter = counter + 1",
            "  return wrk.format(nil, nil, nil, head .. counter .. tail)",
            "end",
        ]
    else:
        lines.append(f"wrk.body = {_lua_long_string(hit_body().decode())}")
    lines += [
        "done = function(summary, latency, requests)",
        "  local e = summary.errors",
        "  io.write(string.format(",
        f'    "{WRK_RESULT_MARK} requests=%d duration_us=%d p50_us=%.1f p90_us=%.1f "',
        '    .. "p99_us=%.1f max_us=%.1f mean_us=%.1f connect=%d read=%d write=%d "',
        '    .. "status=%d timeout=%d\\n",',
        "    summary.requests, summary.duration, latency:percentile(50),",
        "    latency:percentile(90), latency:percentile(99), latency.max, latency.mean,",
        "    e.connect, e.read, e.write, e.status, e.timeout))",
        "end",
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class WrkStats:
    """What one wrk run reports (latencies in microseconds)."""

    requests: int
    duration_s: float
    p50_us: float
    p90_us: float
    p99_us: float
    max_us: float
    mean_us: float
    socket_errors: int
    non_2xx: int
    timeouts: int

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0


class BenchError(RuntimeError):
    """A row could not be measured (a service did not start, a check failed)."""


#: Prefix of the errors of the functional checks made before measuring.
CHECK_FAILED = "check failed: "


def parse_wrk_output(text: str) -> WrkStats:
    """Read the result line of :func:`render_wrk_script`'s ``done`` hook."""
    for line in text.splitlines():
        if line.startswith(WRK_RESULT_MARK + " "):
            fields = dict(part.split("=", 1) for part in line.split()[1:])
            return WrkStats(
                requests=int(fields["requests"]),
                duration_s=int(fields["duration_us"]) / 1e6,
                p50_us=float(fields["p50_us"]),
                p90_us=float(fields["p90_us"]),
                p99_us=float(fields["p99_us"]),
                max_us=float(fields["max_us"]),
                mean_us=float(fields["mean_us"]),
                socket_errors=int(fields["connect"]) + int(fields["read"]) + int(fields["write"]),
                non_2xx=int(fields["status"]),
                timeouts=int(fields["timeout"]),
            )
    raise BenchError(f"wrk printed no {WRK_RESULT_MARK} line; output was:\n{text[-2000:]}")


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _read_stat(pid: int) -> tuple[int, float] | None:
    """(ppid, own + reaped children's CPU seconds) of ``pid``, or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces: split after its ")".
    rest = raw[raw.rindex(")") + 2 :].split()
    ppid = int(rest[1])
    utime, stime, cutime, cstime = (int(v) for v in rest[11:15])
    return ppid, (utime + stime + cutime + cstime) / _CLK_TCK


def parse_context_switches(proc_stat: str) -> int | None:
    """The machine's context switches since boot, from the text of /proc/stat."""
    for line in proc_stat.splitlines():
        name, _, value = line.partition(" ")
        if name == "ctxt" and value.strip().isdigit():
            return int(value)
    return None


def context_switches() -> int | None:
    """The machine's context switches since boot (None where /proc/stat does not say)."""
    try:
        return parse_context_switches(Path("/proc/stat").read_text())
    except OSError:
        return None


def process_tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by ``root`` and its descendants."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = _read_stat(int(entry.name))
            if stat is not None:
                stats[int(entry.name)] = stat
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo, seen = 0.0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total


def http_post(port: int, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """One POST to :data:`REQUEST_PATH` on ``port``: (status, headers, body)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=CHECK_TIMEOUT_S)
    try:
        conn.request("POST", REQUEST_PATH, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data
    except (OSError, http.client.HTTPException) as exc:
        raise BenchError(f"{CHECK_FAILED}POST to {HOST}:{port}: {exc!r}") from exc
    finally:
        conn.close()


def run_wrk(
    port: int, script: Path, concurrency: int, duration_s: int
) -> tuple[WrkStats, float | None]:
    """Run wrk once; return its stats and its own CPU seconds (from wait4)."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise BenchError("wrk is not installed (Debian package 'wrk')")
    argv = [
        wrk,
        f"-t{WRK_THREADS}",
        f"-c{concurrency}",
        f"-d{max(1, duration_s)}s",
        f"--timeout={WRK_REQUEST_TIMEOUT_S}s",
        "--latency",
        "-s",
        str(script),
        f"http://{HOST}:{port}{REQUEST_PATH}",
    ]
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
        rusage = None
        deadline = time.monotonic() + duration_s + WRK_GRACE_S
        try:
            while time.monotonic() < deadline:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid == proc.pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    rusage = usage
                    break
                time.sleep(POLL_INTERVAL_S)
        finally:
            if proc.returncode is None:
                proc.kill()
                proc.wait()
        out.seek(0)
        text = out.read().decode(errors="replace")
    if rusage is None:
        raise BenchError(f"wrk did not finish within {duration_s + WRK_GRACE_S:g} s")
    if proc.returncode != 0:
        raise BenchError(f"wrk exited with code {proc.returncode}:\n{text[-2000:]}")
    return parse_wrk_output(text), rusage.ru_utime + rusage.ru_stime
