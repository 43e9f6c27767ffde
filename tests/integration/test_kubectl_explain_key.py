"""``kubectl cachefleet explain-key`` against real sidecars: its digest is their X-Cache-Key.

A user pastes what ``explain-key`` prints into ``invalidate --scope key
--key``; that only purges something if it is the digest the sidecar names
the entry by. Each test keys a body with the plugin and sends the same body
through a real sidecar in front of the fake upstream, with and without an
``X-Cache-Namespace`` header, and compares with the ``X-Cache-Key`` header
the sidecar answers with.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachefleet_common.epochs import PURGE_SCOPE, namespace_scope
from cachefleet_operator.invalidation import Invalidator
from cachefleet_operator.kubectl_plugin import cli
from tests.integration.conftest import RunningSidecar, SidecarFactory

ACK_TIMEOUT_S = 20.0  # generous: a loaded machine only waits longer
BODY: dict[str, Any] = {
    "model": "m1",
    "messages": [{"role": "user", "content": "What is our refund policy?"}],
    "temperature": 0,
}


def explain_key(tmp_path: Path, *flags: str) -> str:
    """The digest ``explain-key -o key`` prints for BODY."""
    path = tmp_path / "q.json"
    path.write_text(json.dumps(BODY))
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["explain-key", "-o", "key", str(path), *flags], out=out, err=err)
    assert (code, err.getvalue()) == (0, "")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    return lines[0]


async def ask(sc: RunningSidecar, namespace: str | None = None) -> httpx.Response:
    # another spelling of BODY (field order, 0.0): the same entry to the sidecar
    body = {"temperature": 0.0, **BODY}
    headers = {"X-Tenant-ID": "acme"}
    if namespace is not None:
        headers["X-Cache-Namespace"] = namespace
    resp = await sc.client.post("/v1/chat/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp


async def test_the_printed_digest_is_the_sidecars_x_cache_key(
    sidecar: RunningSidecar, tmp_path: Path
) -> None:
    plain = explain_key(tmp_path, "--tenant", "acme")
    namespaced = explain_key(tmp_path, "--tenant", "acme", "--namespace-value", "kb-billing")
    assert plain != namespaced  # a namespace is its own partition
    for namespace, digest in ((None, plain), ("kb-billing", namespaced)):
        miss = await ask(sidecar, namespace)
        hit = await ask(sidecar, namespace)
        assert (miss.headers["x-cache"], hit.headers["x-cache"]) == ("MISS", "HIT-L1")
        assert miss.headers["x-cache-key"] == digest
        assert hit.headers["x-cache-key"] == digest
    # the default tenant is another tenant: the digest names another entry
    assert explain_key(tmp_path) != plain


async def until_acked(sc: RunningSidecar) -> None:
    deadline = time.monotonic() + ACK_TIMEOUT_S
    while time.monotonic() < deadline:
        if sc.server.control.acks_written > 0 and sc.sidecar.tracker.fresh():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the sidecar never acknowledged its epochs")


@pytest.mark.redis
async def test_with_redis_the_epochs_are_part_of_it_and_the_digest_purges_the_entry(
    sidecar_factory: SidecarFactory, redis_url: str, tmp_path: Path
) -> None:
    sc = (await sidecar_factory(redis_url=redis_url)).steady()  # L1 hits asserted below
    await until_acked(sc)
    inv = Invalidator.from_url(redis_url, "test/cache", poll_s=0.05)
    try:
        # the namespace's own epoch moves to 1: it is the fourth of --epochs
        result = await inv.invalidate(
            namespace_scope("acme", "kb-billing"), timeout_s=ACK_TIMEOUT_S
        )
        assert (result.completed, result.epoch) == (True, 1)
        plain = explain_key(tmp_path, "--tenant", "acme", "--epochs", "0,0,0")
        namespaced = explain_key(
            tmp_path, "--tenant", "acme", "--namespace-value", "kb-billing", "--epochs", "0,0,0,1"
        )
        # without the epochs (a sidecar without Redis) the digest is another one
        assert plain != explain_key(tmp_path, "--tenant", "acme")
        assert (await ask(sc)).headers["x-cache-key"] == plain
        miss = await ask(sc, "kb-billing")
        assert (miss.headers["x-cache"], miss.headers["x-cache-key"]) == ("MISS", namespaced)
        assert (await ask(sc, "kb-billing")).headers["x-cache"] == "HIT-L1"
        # what invalidate --scope key --key does with the pasted digest: that entry goes
        epoch, at = await inv.purge(namespaced)
        acked = await inv.await_acks(PURGE_SCOPE, epoch, timeout_s=ACK_TIMEOUT_S, started_at=at)
        assert acked.completed
        assert (await ask(sc, "kb-billing")).headers["x-cache"] == "MISS"
        assert (await ask(sc)).headers["x-cache"] == "HIT-L1"  # the other entry stays
    finally:
        await inv.aclose()


async def test_explain_key_refuses_exactly_the_tenant_names_the_sidecar_refuses(
    sidecar: RunningSidecar, tmp_path: Path
) -> None:
    """Issue 34 (8): one rule for a tenant name, the sidecar's: what it answers 400 to,
    ``explain-key --tenant`` refuses with a usage error, and nothing else."""
    path = tmp_path / "q.json"
    path.write_text(json.dumps(BODY))
    for name in ("acme", "a/b", "x" * 70, "x" * 63, "-a", "a b", "a.b_c-d", "_guests"):
        resp = await sidecar.client.post(
            "/v1/chat/completions", json=BODY, headers={"X-Tenant-ID": name}
        )
        out, err = io.StringIO(), io.StringIO()
        code = cli.main(["explain-key", "-o", "key", str(path), "--tenant", name], out=out, err=err)
        assert (resp.status_code == 400) == (code == cli.EXIT_USAGE), (name, resp.text, code)
        assert code in (0, cli.EXIT_USAGE), err.getvalue()
