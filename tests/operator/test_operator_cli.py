"""``cachefleet operator`` as a user runs it: a process that logs in to the API (the emulator).

Each way of logging in is proved by what the API server sees: the bearer
token of that credential source on its requests, and the operator acting on
an InferenceCache (adding its finalizer). The process gets a bare
environment (an empty HOME, no KUBECONFIG, no in-cluster variables) unless a
case sets them, so nothing on the test machine can stand in for the source
under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachefleet_e2e.k8s import EmulatorHandle, run_emulator, write_kubeconfig
from cachefleet_e2e.services import free_port
from cachefleet_operator.webhook import write_self_signed
from tests.operator.conftest import IC_PATH, NAMESPACE, wait_for

pytestmark = [pytest.mark.k8s_emulator, pytest.mark.slow]

#: Bound on the operator acting after it started, seconds (kopf's start-up included).
ACT_TIMEOUT_S = 30.0
FINALIZER = "cachefleet.io/finalizer"
CACHEFLEET = str(Path(sys.executable).with_name("cachefleet"))


@pytest.fixture
def tls_emulator(tmp_path: Path) -> Iterator[tuple[EmulatorHandle, Path]]:
    (tmp_path / "tls").mkdir()
    cert, key = write_self_signed(["127.0.0.1"], tmp_path / "tls")
    with run_emulator(tls=(str(cert), str(key))) as handle:
        yield handle, cert


def bare_env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"}
    }
    env["HOME"] = str(home)
    env.update(extra)
    return env


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [CACHEFLEET, "operator", "-n", NAMESPACE, "--metrics-port", str(free_port()), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def cache(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "cachefleet.io/v1alpha1",
        "kind": "InferenceCache",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {"cachefleet.io/cache": name}},
            "model": {"name": "llama", "version": "v1"},
            "capacity": {"l1BytesPerPod": 2**20, "l2Bytes": 2**24},
            "redis": {"url": "redis://127.0.0.1:9/0"},
        },
    }


def assert_operates(
    emulator: EmulatorHandle, proc: subprocess.Popen[bytes], log: Path, token: str
) -> None:
    emulator.create(IC_PATH, cache("c1"))

    def finalized() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"operator exited {proc.returncode}:\n{log.read_text()}")
        obj = emulator.get(f"{IC_PATH}/c1") or {}
        return FINALIZER in (obj.get("metadata", {}).get("finalizers") or [])

    wait_for(finalized, ACT_TIMEOUT_S, f"operator never handled c1; log:\n{log.read_text()}")
    seen = {a for a in emulator.emulator.authorizations if a}
    assert seen == {f"Bearer {token}"}, seen


def test_kubeconfig_flag_wins_over_everything(
    tls_emulator: tuple[EmulatorHandle, Path], tmp_path: Path
) -> None:
    emulator, _ = tls_emulator
    flag_file = tmp_path / "flag.kubeconfig"
    write_kubeconfig(str(flag_file), emulator.url, "tok-flag")
    env_file = tmp_path / "env.kubeconfig"
    write_kubeconfig(str(env_file), "http://127.0.0.1:9", "tok-env")
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("tok-sa")
    env = bare_env(
        tmp_path,
        KUBECONFIG=str(env_file),
        KUBERNETES_SERVICE_HOST="127.0.0.1",
        KUBERNETES_SERVICE_PORT="9",
    )
    log = tmp_path / "operator.log"
    proc = start(["--kubeconfig", str(flag_file), "--service-account-dir", str(sa)], env, log)
    try:
        assert_operates(emulator, proc, log, "tok-flag")
    finally:
        stop(proc)


def test_kubeconfig_env_without_flag(
    tls_emulator: tuple[EmulatorHandle, Path], tmp_path: Path
) -> None:
    emulator, _ = tls_emulator
    path = tmp_path / "kubeconfig"
    write_kubeconfig(str(path), emulator.url, "tok-env")
    log = tmp_path / "operator.log"
    proc = start([], bare_env(tmp_path, KUBECONFIG=str(path)), log)
    try:
        assert_operates(emulator, proc, log, "tok-env")
        time.sleep(2.5)  # a few rebalance timer ticks (1 s) of the object
    finally:
        stop(proc)
    # no INFO line per timer tick and object (only with --verbose)
    assert "Timer 'rebalance' succeeded" not in log.read_text()


def test_in_cluster_service_account(
    tls_emulator: tuple[EmulatorHandle, Path], tmp_path: Path
) -> None:
    """A pod's credentials: service host/port variables, token and CA files, HTTPS."""
    emulator, cert = tls_emulator
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("tok-sa\n")
    (sa / "ca.crt").write_bytes(cert.read_bytes())
    (sa / "namespace").write_text(NAMESPACE)
    # a ~/.kube/config pointing elsewhere must not be used in a pod
    (tmp_path / ".kube").mkdir()
    write_kubeconfig(str(tmp_path / ".kube" / "config"), "http://127.0.0.1:9", "tok-home")
    env = bare_env(
        tmp_path,
        KUBERNETES_SERVICE_HOST="127.0.0.1",
        KUBERNETES_SERVICE_PORT=str(emulator.tls_port),
    )
    log = tmp_path / "operator.log"
    proc = start(["--service-account-dir", str(sa)], env, log)
    try:
        assert_operates(emulator, proc, log, "tok-sa")
    finally:
        stop(proc)


def test_operator_and_emulator_as_two_processes(tmp_path: Path) -> None:
    """The no-cluster walk-through of the README: emulator server, then the operator."""
    path = tmp_path / "emu.kubeconfig"
    server = subprocess.Popen(
        [sys.executable, "-m", "cachefleet_e2e.emulator_server", "--kubeconfig", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log = tmp_path / "operator.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith("ready "), line
        url = line.split()[1]
        proc = start(["--kubeconfig", str(path)], bare_env(tmp_path), log)
        with httpx.Client(base_url=url, timeout=5) as client:
            client.post(IC_PATH, json=cache("c1")).raise_for_status()

            def finalized() -> bool:
                assert proc is not None
                if proc.poll() is not None:
                    pytest.fail(f"operator exited {proc.returncode}:\n{log.read_text()}")
                meta = client.get(f"{IC_PATH}/c1").json().get("metadata", {})
                return FINALIZER in (meta.get("finalizers") or [])

            wait_for(finalized, ACT_TIMEOUT_S, "operator never handled c1")
    finally:
        if proc is not None:
            stop(proc)
        server.terminate()
        server.wait(15)
    assert server.returncode == 0


@pytest.mark.parametrize("flag", [False, True])
def test_no_credentials_exits_with_reason(tmp_path: Path, flag: bool) -> None:
    args = ["--service-account-dir", str(tmp_path / "none")]
    if flag:
        args += ["--kubeconfig", str(tmp_path / "missing.kubeconfig")]
    result = subprocess.run(
        [CACHEFLEET, "operator", "-n", NAMESPACE, "--metrics-port", str(free_port()), *args],
        env=bare_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    expected = "missing.kubeconfig: no such file" if flag else "cannot log in with kubeconfig"
    assert expected in result.stderr


def test_the_recorded_epoch_retry_is_not_logged_as_an_error() -> None:
    """kopf logs each TemporaryError as an error; the planned one after recording is INFO."""
    import logging

    from cachefleet_operator.invalidation import RECORDED_MARK
    from cachefleet_operator.run import _RecordedIsNoError

    logger = logging.getLogger("kopf.objects.test-recorded")
    flt = _RecordedIsNoError()
    planned = logger.makeRecord(
        logger.name, logging.ERROR, __file__, 1, f"failed temporarily: x {RECORDED_MARK}", (), None
    )
    real = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, "Redis down", (), None)
    logger.setLevel(logging.WARNING)
    assert flt.filter(planned) is False  # dropped unless INFO is on
    assert planned.levelname == "INFO"
    assert flt.filter(real) is True
    assert real.levelname == "ERROR"
    logger.setLevel(logging.INFO)
    assert flt.filter(
        logger.makeRecord(logger.name, logging.ERROR, __file__, 1, RECORDED_MARK, (), None)
    )
