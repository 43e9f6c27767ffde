"""``cachefleet router``: bad flags get clear errors; the real command serves the protocol."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import httpx
import pytest

from cachefleet_operator.cli import main as cachefleet
from cachefleet_router.cli import main, parse_args
from cachefleet_router.health import HealthCheckRequest, HealthCheckResponse

from .conftest import Gateway, MetricsServer, body_message, headers_message

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 20.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give exactly one of --endpoints, --pool-name, --selector"),
        (["--endpoints", "a:1", "--pool-name", "p"], "(got --endpoints, --pool-name)"),
        (["--endpoints", "localhost"], "--endpoints: expected HOST:PORT"),
        (["--endpoints", "h:99999"], "--endpoints: port must be 0..65535"),
        (["--endpoints", "h:0"], "--endpoints: an endpoint needs a real port"),
        (["--endpoints", " , "], "--endpoints: no endpoint given"),
        (["--selector", "app=vllm"], "--selector needs --target-port"),
        (["--pool-name", "p", "--target-port", "8000"], "--target-port goes with --selector"),
        (["--selector", "app", "--target-port", "1"], "--selector: expected key=value"),
        (["--selector", "app=v", "--target-port", "x"], "--target-port: invalid literal"),
        (["--selector", "app=v", "--target-port", "0"], "--target-port: expected 1..65535"),
        (["--endpoints", "a:1", "--redis-url", "redis://h:6379"], "--redis-url and --cache go"),
        (["--endpoints", "a:1", "--redis-url", "redis://h", "--cache", "x"], "--cache: expected"),
        (["--endpoints", "a:1", "--redis-url", "http://h", "--cache", "a/b"], "--redis-url: "),
        (["--endpoints", "a:1", "--grpc-listen", "9002"], "--grpc-listen: expected HOST:PORT"),
        (["--endpoints", "a:1", "--metrics-listen", "h:x"], "--metrics-listen: port must be"),
        (["--endpoints", "a:1", "--scrape-interval", "-1"], "--scrape-interval: expected a pos"),
        (["--endpoints", "a:1", "--scrape-interval", "soon"], "--scrape-interval: could not"),
        (["--endpoints", "a:1", "--tenant-poll", "0"], "--tenant-poll: expected a positive"),
        (["--endpoints", "a:1", "--fail-open", "--fail-closed"], "not allowed with argument"),
        (["--endpoints", "a:1", "--log-level", "loud"], "--log-level: expected debug"),
        (["--endpoints", "a:1", "--kubeconfig", "k"], "--kubeconfig is for --pool-name"),
        (["--endpoints", "a:1", "--max-body-memory", "lots"], "--max-body-memory: expected a"),
        (["--endpoints", "a:1", "--max-streams", "0"], "--max-streams: expected a count > 0"),
        (["--endpoints", "a:1", "--max-metrics-bytes", "-4Mi"], "--max-metrics-bytes: expec"),
        (["--endpoints", "a:1", "--scrape-timeout", "0"], "--scrape-timeout: expected a pos"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config, level = parse_args(
        ["--endpoints", "10.0.0.1:8000, [fd00::1]:8000,10.0.0.1:8000", "--fail-open"]
    )
    assert config.endpoints == ("10.0.0.1:8000", "[fd00::1]:8000")
    assert config.fail_open
    assert level == "info"
    assert config.grpc_listen == ("0.0.0.0", 9002)
    assert config.metrics_listen == ("0.0.0.0", 9090)
    assert config.scrape_interval_s == 0.5
    assert config.tenant_header == "X-Tenant-ID"
    monkeypatch.setenv("CACHEFLEET_SELECTOR", "app=vllm,tier=gpu")
    monkeypatch.setenv("CACHEFLEET_TARGET_PORT", "8000")
    monkeypatch.setenv("CACHEFLEET_NAMESPACE", "ml")
    monkeypatch.setenv("CACHEFLEET_FAIL_OPEN", "true")
    config, _ = parse_args([])
    assert config.selector == {"app": "vllm", "tier": "gpu"}
    assert config.target_ports == (8000,)
    assert config.namespace == "ml"
    assert config.fail_open
    config, _ = parse_args(["--fail-closed"])  # a flag wins over the environment
    assert not config.fail_open


def test_limit_and_conformance_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config, _ = parse_args(["--endpoints", "a:1"])
    assert (config.scrape_timeout_s, config.max_metrics_bytes) == (1.0, 4 * 1024 * 1024)
    assert (config.max_body_bytes, config.max_body_memory) == (16 * 1024**2, 256 * 1024**2)
    assert (config.max_streams, config.conformance) == (10_000, False)
    config, _ = parse_args(
        [
            "--endpoints",
            "a:1",
            "--scrape-timeout",
            "2.5",
            "--max-metrics-bytes",
            "1Mi",
            "--max-body-bytes",
            "64Ki",
            "--max-body-memory",
            "32M",
            "--max-streams",
            "500",
            "--conformance",
        ]
    )
    assert (config.scrape_timeout_s, config.max_metrics_bytes) == (2.5, 1024 * 1024)
    assert (config.max_body_bytes, config.max_body_memory) == (64 * 1024, 32 * 1024**2)
    assert (config.max_streams, config.conformance) == (500, True)
    monkeypatch.setenv("CACHEFLEET_MAX_BODY_MEMORY", "1Gi")
    monkeypatch.setenv("CACHEFLEET_MAX_STREAMS", "7")
    monkeypatch.setenv("CACHEFLEET_CONFORMANCE", "true")
    config, _ = parse_args(["--endpoints", "a:1"])
    assert (config.max_body_memory, config.max_streams, config.conformance) == (1024**3, 7, True)


def test_registered_as_a_cachefleet_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cachefleet([]) == 2
    assert "router" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        cachefleet(["router", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--grpc-listen", "--pool-name", "--fail-open", "CACHEFLEET_ENDPOINTS"):
        assert flag in out


def test_missing_kubeconfig_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "--pool-name",
            "llm",
            "--kubeconfig",
            "/nonexistent/kubeconfig",
            "--grpc-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
        ]
    )
    assert code == 2
    assert "--kubeconfig /nonexistent/kubeconfig: no such file" in capsys.readouterr().err


def test_an_address_in_use_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flags = ["--endpoints", "127.0.0.1:1", "--grpc-listen", "127.0.0.1:0"]
        code = main([*flags, "--metrics-listen", f"127.0.0.1:{port}"])
    assert code == 1
    assert f"--metrics-listen 127.0.0.1:{port}: " in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def until(check: Callable[[], Awaitable[bool]], message: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not await check():
        if loop.time() > deadline:
            pytest.fail(f"timed out: {message}")
        await asyncio.sleep(0.1)


async def test_the_command_serves_health_metrics_and_the_protocol(
    metrics_servers: Callable[..., Awaitable[MetricsServer]],
) -> None:
    busy, idle = await metrics_servers(waiting=9, running=4), await metrics_servers()
    grpc_port, http_port = free_port(), free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            str(ROOT / d) for d in ("operator", "sidecar", "bench", "e2e", "router")
        ),
    }
    proc = await asyncio.create_subprocess_exec(
        *[
            sys.executable,
            "-m",
            "cachefleet_operator.cli",
            "router",
            "--endpoints",
            f"{busy.address},{idle.address}",
            "--grpc-listen",
            f"127.0.0.1:{grpc_port}",
            "--metrics-listen",
            f"127.0.0.1:{http_port}",
            "--scrape-interval",
            "0.2",
        ],
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=5.0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    try:

        async def both_ready() -> bool:
            if proc.returncode is not None:
                assert proc.stdout is not None
                pytest.fail(f"the router exited: {(await proc.stdout.read()).decode()}")
            try:
                text = (await http.get("/metrics")).text
            except httpx.HTTPError:
                return False
            return "cachefleet_router_endpoints_ready 2.0" in text

        await until(both_ready, "both endpoints read")
        assert (await http.get("/healthz")).status_code == 200
        ready = await http.get("/readyz")
        assert ready.status_code == 200
        assert "2 of 2" in ready.text

        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString,
        )
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            answer = await check(HealthCheckRequest(service=service))
            assert answer.status == 1, service  # SERVING
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await check(HealthCheckRequest(service="nope"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        gw = Gateway(channel)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        head, _ = await gw.exchange(
            [
                headers_message({":path": "/v1/chat/completions"}),
                body_message(body.encode(), end_of_stream=True),
            ],
            2,
        )
        picked = head.request_headers.response.header_mutation.set_headers[0].header.raw_value
        assert picked.decode() == idle.address  # the scoring picker: the shorter queue

        await busy.stop()  # gone: out after two failed reads, and the router says so
        await until(
            lambda: _contains(http, "cachefleet_router_endpoints_ready 1.0"),
            "the dead endpoint out",
        )
        text = (await http.get("/metrics")).text
        decided = f'endpoint="{idle.address}",reason="ttft"'
        assert f"cachefleet_router_decisions_total{{{decided}}} 1.0" in text
        assert "cachefleet_router_decision_seconds_count 1.0" in text
        assert f'cachefleet_router_scrape_failures_total{{endpoint="{busy.address}"}}' in text

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), WAIT_S) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await channel.close()
        await http.aclose()


async def _contains(http: httpx.AsyncClient, needle: str) -> bool:
    try:
        return needle in (await http.get("/metrics")).text
    except httpx.HTTPError:
        return False
