"""Tracing's switch and its pure parts: off by default with nothing of OpenTelemetry
imported (checked in a fresh interpreter), the ``--otlp-endpoint`` flag and its
environment variable, the OTLP/HTTP traces URL."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cachefleet_sidecar.config import parse_args
from cachefleet_sidecar.observe.tracing import EXPORT_TIMEOUT_S, export_timeout_s, traces_url

# redis-py 8 imports OpenTelemetry's metrics SDK (and the trace API) on its own whenever
# it is installed: what counts is what the sidecar adds to what ``import redis`` loads.
OFF_PROBE = """
import sys

def otel():
    return {m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")}

import redis
baseline = otel()
from cachefleet_sidecar.compose import build
from cachefleet_sidecar.config import parse_args
sidecar = build(parse_args(["--upstream", "http://127.0.0.1:9"]))
assert sidecar.tracing is None and sidecar.front is sidecar.handler
added = sorted(otel() - baseline)
added += sorted(m for m in sys.modules if m.startswith("cachefleet_sidecar.observe.trac"))
ours = ("opentelemetry.sdk.trace", "opentelemetry.exporter")
added += sorted(m for m in ours if m in sys.modules)
print(",".join(added))
"""


def test_tracing_off_imports_nothing_of_opentelemetry() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFLEET_")}
    done = subprocess.run(
        [sys.executable, "-c", OFF_PROBE],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_otlp_endpoint_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CACHEFLEET_OTLP_ENDPOINT", raising=False)
    assert parse_args([]).observe.otlp_endpoint == ""
    flag = parse_args(["--otlp-endpoint", "http://collector:4318"])
    assert flag.observe.otlp_endpoint == "http://collector:4318"
    monkeypatch.setenv("CACHEFLEET_OTLP_ENDPOINT", "https://otel.example:4318/v1/traces")
    assert parse_args([]).observe.otlp_endpoint == "https://otel.example:4318/v1/traces"


def test_otlp_endpoint_must_be_an_http_url(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--otlp-endpoint", "collector:4317"])
    assert "--otlp-endpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("http://c:4318", "http://c:4318/v1/traces"),
        ("http://c:4318/", "http://c:4318/v1/traces"),
        ("http://c:4318/v1/traces", "http://c:4318/v1/traces"),
        ("https://gw/otlp", "https://gw/otlp/v1/traces"),
    ],
)
def test_traces_url_adds_the_otlp_path_to_a_base_url(given: str, url: str) -> None:
    assert traces_url(given) == url


def test_without_the_tracing_extra_the_sidecar_runs_untraced_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # what an image without cachefleet[tracing] does when the CRD asks for traces
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.resources", None)
    from cachefleet_sidecar.compose import build

    config = parse_args(["--otlp-endpoint", "http://collector:4318"])
    sidecar = build(config)
    assert sidecar.tracing is None
    assert sidecar.front is sidecar.handler
    assert "install cachefleet[tracing]" in caplog.text


def test_exports_are_bounded_unless_the_opentelemetry_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TIMEOUT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", raising=False)
    assert export_timeout_s() == EXPORT_TIMEOUT_S
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "20")
    assert export_timeout_s() is None  # the SDK reads it
