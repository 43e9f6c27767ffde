"""rediss:// with a private CA and an ACL user: the sidecar's L2 and control sync over TLS."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefleet_common.contract.acls import sidecar_acl
from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_e2e.services import RedisServer, free_port, redis_command

from .conftest import SidecarFactory

pytestmark = pytest.mark.redis

PASSWORD = "tls-sidecar-pw"  # a throwaway test password


def openssl(tmp: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True, timeout=60)


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(rediss:// URL of an ACL user, CA file) of a Redis that also listens with TLS."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    openssl(tmp_path, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
            "-out", "ca.crt", "-days", "1", "-subj", "/CN=cachefleet test CA")  # fmt: skip
    openssl(tmp_path, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "redis.key",
            "-out", "redis.csr", "-subj", "/CN=127.0.0.1")  # fmt: skip
    (tmp_path / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(tmp_path, "x509", "-req", "-in", "redis.csr", "-CA", "ca.crt", "-CAkey",
            "ca.key", "-CAcreateserial", "-out", "redis.crt", "-days", "1",
            "-extfile", "san.cnf")  # fmt: skip
    tls_port = free_port()
    args = ["--tls-port", str(tls_port), "--tls-cert-file", str(tmp_path / "redis.crt"),
            "--tls-key-file", str(tmp_path / "redis.key"),
            "--tls-ca-cert-file", str(tmp_path / "ca.crt"), "--tls-auth-clients", "no"]  # fmt: skip
    with RedisServer(extra_args=args) as server:
        acl = sidecar_acl("test/cache")
        reply = redis_command(
            server.port, "ACL", "SETUSER", "cf-sidecar", "on", f">{PASSWORD}", *acl
        )
        assert reply.startswith(b"+OK"), reply
        url = f"rediss://cf-sidecar:{PASSWORD}@127.0.0.1:{tls_port}/0"
        yield url, tmp_path / "ca.crt"


async def test_sidecar_over_tls_with_an_acl_user(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, tls_redis: tuple[str, Path]
) -> None:
    url, ca = tls_redis
    with_ca = f"{url}?ssl_ca_certs={ca}"
    pod_a = await sidecar_factory(redis_url=with_ca)
    pod_b = await sidecar_factory(redis_url=with_ca, pod="pod-b")
    # A TLS handshake can outlast the L2's 50 ms budget on a loaded machine (the breaker then
    # retries): ask until one answer written by pod-a is read by pod-b through L2.
    deadline = time.monotonic() + 20.0
    for attempt in range(1000):
        await pod_a.chat(f"over TLS {attempt}")
        await asyncio.sleep(0.3)
        if (await pod_b.chat(f"over TLS {attempt}")).headers["x-cache"] == "HIT-L2":
            break
        assert time.monotonic() < deadline, "no L2 hit over TLS"
    status = (await pod_b.admin.get("/status")).json()
    assert status["redis"] == "ok"
    assert status["epochs_confirmed"] is True  # the control sync (pub/sub, polls) works too
    assert PASSWORD not in str(status)

    # Without the CA the server's certificate is not trusted: no L2, and no error either.
    untrusting = await sidecar_factory(redis_url=url, pod="pod-c")
    resp = await untrusting.chat("over TLS")
    assert resp.status_code == 200
    assert resp.headers["x-cache"] == "MISS"
    assert (await untrusting.admin.get("/status")).json()["redis"] != "ok"
