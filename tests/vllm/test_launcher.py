"""The launcher's own behaviour, with a stand-in for vLLM's interpreter (no vLLM needed):
what it runs, how it fails, and the relaunch of a server that dies while starting."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cachefleet_e2e.services import ServiceError
from cachefleet_e2e.vllm_server import (
    VLLM_PYTHON_ENV,
    VllmServer,
    VllmUnavailable,
    start_all,
    vllm_python,
)

#: A stand-in for vLLM's python: dies like a failed engine start the first time (when
#: FAKE_MARKER does not exist yet), then serves /health on --port.
FAKE_VLLM = f"""#!{sys.executable}
import http.server, json, os, pathlib, sys
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
marker = pathlib.Path(os.environ["FAKE_MARKER"])
pathlib.Path(os.environ["FAKE_ARGS"]).write_text(json.dumps(args))
if not marker.exists():
    marker.write_text("failed once")
    print("RuntimeError: Engine core initialization failed. See root cause above.")
    print("a long tail of other lines\\n" * 200)
    sys.exit(1)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def fake_server(tmp_path: Path, **kwargs: object) -> VllmServer:
    python = tmp_path / "python"
    python.write_text(FAKE_VLLM)
    python.chmod(0o755)
    env = {"FAKE_MARKER": str(tmp_path / "marker"), "FAKE_ARGS": str(tmp_path / "args")}
    return VllmServer(
        tmp_path / "model",
        python=python,
        extra_env=env,
        cache_root=tmp_path / "cache",
        **kwargs,  # type: ignore[arg-type]
    )


def test_a_server_that_dies_while_starting_is_launched_again(tmp_path: Path) -> None:
    server = fake_server(tmp_path)
    try:
        start_all([server], timeout_s=60)
        assert server.running
        assert server.start_s is not None
        (failure,) = server.failures
        # The root cause is quoted even though the log's end is elsewhere.
        assert "Engine core initialization failed" in failure
    finally:
        server.stop()
    assert not server.running


def test_a_single_attempt_fails_with_the_logs_error(tmp_path: Path) -> None:
    server = fake_server(tmp_path)
    with pytest.raises(ServiceError, match="Engine core initialization failed"):
        start_all([server], timeout_s=60, attempts=1)
    assert not server.running


def test_the_command_line_has_what_the_tier_relies_on(tmp_path: Path) -> None:
    server = fake_server(tmp_path, num_blocks=40, extra_args=["--max-num-seqs", "4"])
    (tmp_path / "marker").write_text("start at once")
    try:
        server.start(timeout_s=60)
        args = json.loads((tmp_path / "args").read_text())
    finally:
        server.stop()
    assert args[:2] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]

    def flag(name: str) -> str:
        value: str = args[args.index(name) + 1]
        return value

    assert "--enforce-eager" in args
    assert "--enable-prefix-caching" in args
    assert flag("--host") == "127.0.0.1"
    assert flag("--port") == str(server.port)
    assert flag("--num-gpu-blocks-override") == "40"
    # Always an explicit size (else vLLM refuses to start when 8 % of the memory is in use).
    assert flag("--kv-cache-memory-bytes") == str(16 * 1024 * 1024)
    events = json.loads(flag("--kv-events-config"))
    assert events["endpoint"] == f"tcp://*:{server.kv_events_port}"
    assert events["enable_kv_cache_events"] is True
    assert args[-2:] == ["--max-num-seqs", "4"]
    env = server.environment()
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache")
    assert "PYTHONPATH" not in env  # the project's path must not reach vLLM's interpreter


def test_a_missing_interpreter_says_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(VllmUnavailable, match="make vllm-env"):
        vllm_python()
