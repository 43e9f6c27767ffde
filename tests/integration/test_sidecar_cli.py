"""`cachefleet sidecar` as a process: flags, environment, uvloop, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_e2e.services import free_port

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def cachefleet(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cachefleet_operator.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


def wait_ready(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url} not ready within {timeout_s}s")


@pytest.fixture
def sidecar_process(upstream: FakeUpstream) -> Iterator[tuple[str, str, subprocess.Popen[str]]]:
    port, admin = free_port(), free_port()
    proc = cachefleet(
        "sidecar",
        "--listen",
        f"127.0.0.1:{port}",
        "--upstream",
        upstream.url,
        "--trusted-proxies",
        "127.0.0.1/32",
        env={"CACHEFLEET_ADMIN_LISTEN": f"127.0.0.1:{admin}", "CACHEFLEET_POLICY": "lirs"},
    )
    try:
        wait_ready(f"http://127.0.0.1:{admin}/healthz")
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)


def test_the_command_serves_hits_and_stops_cleanly_on_sigterm(
    sidecar_process: tuple[str, str, subprocess.Popen[str]],
) -> None:
    url, admin, proc = sidecar_process
    headers = {"X-Tenant-ID": "acme"}
    first = httpx.post(url + "/v1/chat/completions", json=BODY, headers=headers)
    second = httpx.post(url + "/v1/chat/completions", json=BODY, headers=headers)
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("MISS", "HIT-L1")
    assert second.json() == first.json()
    status = httpx.get(admin + "/status").json()
    assert status["tenants"]["acme"]["policy"] == "lirs"  # from CACHEFLEET_POLICY
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


def test_bad_flags_name_the_flag() -> None:
    proc = cachefleet("sidecar", "--l1-bytes", "lots")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "--l1-bytes" in out
    proc = cachefleet("sidecar", "--cache", "no-slash")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "NAMESPACE/NAME" in out
    proc = cachefleet("sidecar", "--trusted-proxies", "10.0.0.0/8,gateway")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "--trusted-proxies" in out
    assert "'gateway'" in out
    for flag, value, words in (
        ("--guest-share", "0.95", "fraction from 0 to 0.9"),
        ("--tenant-idle-expiry", "-1", "seconds >= 0"),
        ("--redis-outage-staleness", "soon", "--redis-outage-staleness"),
        ("--max-tenants", "0", "positive integer"),
    ):
        proc = cachefleet("sidecar", flag, value)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 2
        assert flag in out
        assert words in out


def test_a_bad_keys_file_is_refused_without_printing_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text('{"sk-very-secret": "alpha", "sk-also-secret": "not valid"}')
    proc = cachefleet("sidecar", "--api-keys-file", str(path))
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "--api-keys-file: entry 2: tenant" in out
    assert "secret" not in out


def test_unknown_command_is_explained() -> None:
    proc = cachefleet("frobnicate")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "unknown command" in out
    assert "sidecar" in out
