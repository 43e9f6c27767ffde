"""Who is the tenant, black-box over real sockets: the rules of docs/security.md.

Every test plants a *victim* tenant's answer first and then tries to read it
with a forged identity; the victim's answer must never come back (no HIT for
the forger, a different upstream answer), and the attempt must be counted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import pytest

from cachefleet_e2e.fake_upstream import FakeUpstream

from .conftest import RunningSidecar, SidecarFactory
from .test_sidecar import CHAT, answer, metric

KEYS = {"sk-alpha-0123456789": "alpha", "sk-beta-0123456789": "beta"}
ALPHA = {"Authorization": "Bearer sk-alpha-0123456789"}
BETA = {"Authorization": "Bearer sk-beta-0123456789"}


async def mismatches(sc: RunningSidecar, reason: str) -> float:
    text = (await sc.admin.get("/metrics")).text
    return metric(text, "cachefleet_identity_mismatches_total", reason=reason) or 0.0


async def plant_victim(sc: RunningSidecar, content: str = "the victim's secret") -> str:
    """beta's answer to ``content``, cached (L1 hit on the second read)."""
    first = await sc.chat(content, tenant=None, headers=BETA)
    assert first.headers["x-cache"] == "MISS"
    again = await sc.chat(content, tenant=None, headers=BETA)
    assert again.headers["x-cache"] == "HIT-L1"
    return answer(first)


async def test_with_keys_a_forged_header_never_reads_another_tenant(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(api_keys=KEYS)
    secret = await plant_victim(sc)

    # alpha's key with beta's name in the header: alpha is served, from alpha's own partition.
    forged = await sc.chat("the victim's secret", tenant="beta", headers=ALPHA)
    assert forged.status_code == 200
    assert forged.headers["x-cache"] == "MISS"
    assert answer(forged) != secret
    assert await mismatches(sc, "header_ignored") == 1
    # The model server is told the tenant that was decided, not the one claimed.
    assert upstream.seen_headers[-1]["x-tenant-id"] == "alpha"

    # A wrong key, or no key at all, with the victim's name: refused with a reason.
    wrong = await sc.chat(
        "the victim's secret", tenant="beta", headers={"Authorization": "Bearer sk-guess"}
    )
    assert wrong.status_code == 401
    assert "invalid API key" in wrong.json()["error"]["message"]
    assert wrong.headers["www-authenticate"].startswith("Bearer")
    none = await sc.chat("the victim's secret", tenant="beta")
    assert none.status_code == 401
    assert "API key is required" in none.json()["error"]["message"]
    basic = await sc.chat(
        "the victim's secret", tenant="beta", headers={"Authorization": "Basic YmV0YTpiZXRh"}
    )
    assert basic.status_code == 401
    assert await mismatches(sc, "invalid_key") == 2
    assert await mismatches(sc, "missing_key") == 1
    # Two Authorization headers (first valid for beta) are ambiguous, not "the first wins".
    # (httpx folds repeated headers, so this one goes over a raw socket.)
    raw = await raw_request(
        sc,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer sk-beta-0123456789\r\nAuthorization: Bearer sk-alpha-0123456789"
        b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
        json.dumps(chat_body("the victim's secret")).encode(),
    )
    assert raw.startswith(b"HTTP/1.1 400"), raw[:200]

    # beta itself still gets its answer; nobody else ever did.
    owner = await sc.chat("the victim's secret", tenant=None, headers=BETA)
    assert owner.headers["x-cache"] == "HIT-L1"
    assert answer(owner) == secret
    assert await metric_value(sc, "cachefleet_cross_tenant_hits_total") == 0


async def test_with_keys_the_default_tenant_is_only_for_keyless_requests(
    sidecar_factory: SidecarFactory,
) -> None:
    sc = await sidecar_factory(api_keys=KEYS, default_tenant="public")
    secret = await plant_victim(sc)
    anon = await sc.chat("the victim's secret", tenant="beta")
    assert anon.status_code == 200
    assert anon.headers["x-cache"] == "MISS"
    assert answer(anon) != secret
    assert "public" in sc.sidecar.l1.stats()
    assert await mismatches(sc, "header_ignored") == 1
    # A wrong key is an error, never "anonymous".
    wrong = await sc.chat("x", tenant=None, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


async def test_header_is_believed_only_from_trusted_networks(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    trusting = await sidecar_factory()  # trusts 127.0.0.1/32: the test client
    await trusting.chat("q", tenant="beta")
    assert (await trusting.chat("q", tenant="beta")).headers["x-cache"] == "HIT-L1"

    elsewhere = await sidecar_factory(trusted_proxies=("10.0.0.0/8", "fd00::/8"))
    refused = await elsewhere.chat("q", tenant="beta")
    assert refused.status_code == 403
    assert "--trusted-proxies" in refused.json()["error"]["message"]
    assert await mismatches(elsewhere, "untrusted_header") == 1

    # Two tenant headers, even from a trusted peer, are ambiguous: refused, not "first wins".
    raw = await raw_request(
        trusting,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Tenant-ID: alpha\r\n"
        b"X-Tenant-ID: beta\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
        json.dumps(chat_body("q")).encode(),
    )
    assert raw.startswith(b"HTTP/1.1 400"), raw[:200]
    assert await mismatches(trusting, "ambiguous") == 1

    nobody = await sidecar_factory(trusted_proxies=(), default_tenant="public")
    # No header: the default tenant. A header from an untrusted peer: refused, not defaulted.
    assert (await nobody.chat("q", tenant=None)).status_code == 200
    assert (await nobody.chat("q", tenant="beta")).status_code == 403
    assert "beta" not in nobody.sidecar.l1.stats()


def chat_body(content: str) -> dict[str, object]:
    return {"model": "m1", "messages": [{"role": "user", "content": content}], "temperature": 0}


async def raw_request(sc: RunningSidecar, head: bytes, body: bytes = b"") -> bytes:
    """Send bytes over a fresh socket and read until the server closes (bounded)."""
    host, port = sc.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head % (len(body), body) if b"%d" in head else head)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(1 << 20), 10.0)
    writer.close()
    return data


def chunked(body: bytes, trailers: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(body), body, trailers)


async def test_trailers_never_name_the_tenant(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    body = json.dumps(chat_body("the victim's secret")).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n"
    )
    # Header mode: the trailer's X-Tenant-ID is not a header; without one there is no tenant.
    sc = await sidecar_factory()
    await sc.chat("the victim's secret", tenant="beta")
    reply = await raw_request(sc, head + b"\r\n" + chunked(body, b"X-Tenant-ID: beta\r\n"))
    assert reply.startswith(b"HTTP/1.1 403"), reply[:200]
    assert b"HIT" not in reply

    # Key mode: a trailer carrying beta's key is not a credential either.
    keyed = await sidecar_factory(api_keys=KEYS)
    await plant_victim(keyed)
    trailer = b"Authorization: Bearer sk-beta-0123456789\r\nX-Tenant-ID: beta\r\n"
    reply = await raw_request(keyed, head + b"\r\n" + chunked(body, trailer))
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    # With alpha's key in the head, a trailer naming beta changes nothing and is not forwarded.
    calls = upstream.calls[CHAT]
    reply = await raw_request(
        keyed,
        head + b"Authorization: Bearer sk-alpha-0123456789\r\n\r\n" + chunked(body, trailer),
    )
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert b"x-cache: miss" in reply.lower()
    assert upstream.calls[CHAT] == calls + 1
    seen = upstream.seen_headers[-1]
    assert seen["x-tenant-id"] == "alpha"
    assert "sk-beta" not in seen.get("authorization", "")


async def metric_value(sc: RunningSidecar, name: str) -> float:
    return metric((await sc.admin.get("/metrics")).text, name) or 0.0


def write_keys(path: Path, mapping: dict[str, str]) -> None:
    """Replace the file the way Kubernetes updates a mounted Secret (a new inode, swapped in)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(mapping))
    os.replace(tmp, path)


async def test_keys_file_takes_digests_and_is_reloaded_without_logging_keys(
    sidecar_factory: SidecarFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "keys.json"
    new_key = "sk-rotated-abcdef"
    digest = "sha256:" + hashlib.sha256(new_key.encode()).hexdigest()
    write_keys(path, {"sk-old-key-123456": "alpha"})
    sc = await sidecar_factory(api_keys_file=str(path))
    old = {"Authorization": "Bearer sk-old-key-123456"}
    new = {"Authorization": f"Bearer {new_key}"}
    assert (await sc.chat("q", tenant=None, headers=old)).status_code == 200
    assert (await sc.chat("q", tenant=None, headers=new)).status_code == 401

    write_keys(path, {digest: "alpha"})  # rotation: only the digest of the new key
    deadline = time.monotonic() + 15.0
    while (await sc.chat("q", tenant=None, headers=new)).status_code != 200:
        assert time.monotonic() < deadline, "the rotated keys file was never picked up"
        await asyncio.sleep(0.2)
    assert (await sc.chat("q", tenant=None, headers=new)).headers["x-cache"] == "HIT-L1"
    assert (await sc.chat("q", tenant=None, headers=old)).status_code == 401

    # A broken file keeps the keys in force and says why (without any key).
    path.write_text('{"sk-secret-in-broken-file": "not a valid tenant!"}')
    deadline = time.monotonic() + 15.0
    while sc.sidecar.tenants.api_keys is not None and sc.sidecar.tenants.api_keys.error is None:
        assert time.monotonic() < deadline, "the broken keys file was never noticed"
        await asyncio.sleep(0.2)
    assert (await sc.chat("q", tenant=None, headers=new)).status_code == 200
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "not reloaded" in logged
    for secret in ("sk-old-key-123456", new_key, digest[7:], "sk-secret-in-broken-file"):
        assert secret not in logged
        assert secret not in (await sc.admin.get("/status")).text


@pytest.mark.redis
async def test_l2_forged_identities_never_read_the_victims_entries(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, redis_url: str
) -> None:
    pod_a = await sidecar_factory(api_keys=KEYS, redis_url=redis_url, patient=True)
    first = await pod_a.chat("in L2", tenant=None, headers=BETA)
    await pod_a.stored()
    pod_b = await sidecar_factory(api_keys=KEYS, redis_url=redis_url, pod="pod-b", patient=True)
    owner = await pod_b.chat("in L2", tenant=None, headers=BETA)
    assert owner.headers["x-cache"] == "HIT-L2"  # the entry is really in L2
    secret = answer(first)

    # patient: the forged read really reaches L2 (a 50 ms timeout would also be a MISS)
    pod_c = await sidecar_factory(api_keys=KEYS, redis_url=redis_url, pod="pod-c", patient=True)
    forged = await pod_c.chat("in L2", tenant="beta", headers=ALPHA)
    assert forged.headers["x-cache"] == "MISS"
    assert answer(forged) != secret
    for attempt in ({"Authorization": "Bearer sk-wrong"}, {}):
        refused = await pod_c.chat("in L2", tenant="beta", headers=attempt)
        assert refused.status_code == 401
    assert "beta" not in pod_c.sidecar.l1.stats()

    # A trailer carrying beta's key, against the same L2: not a credential.
    body = json.dumps(chat_body("in L2")).encode()
    reply = await raw_request(
        pod_c,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n"
        + chunked(body, b"Authorization: Bearer sk-beta-0123456789\r\nX-Tenant-ID: beta\r\n"),
    )
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]

    # Header mode from an untrusted source, against the same L2.
    header_pod = await sidecar_factory(
        redis_url=redis_url, pod="pod-d", trusted_proxies=("192.0.2.0/24",)
    )
    assert (await header_pod.chat("in L2", tenant="beta")).status_code == 403
    assert await metric_value(pod_c, "cachefleet_cross_tenant_hits_total") == 0


# ------------------------------------------- every path reaching the model server
#: Targets a model server may route to its chat endpoint (uvicorn routes the absolute
#: form and decodes %2F), or to any other endpoint: identity is decided for all of them.
VARIANTS = [
    b"http://evil/v1/chat/completions",
    b"/v1//chat/completions",
    b"/V1/chat/completions",
    b"/v1/chat/completions/",
    b"/v1%2Fchat/completions",
    b"/v1/models",
]


async def send_raw(sc: RunningSidecar, target: bytes, headers: bytes, body: bytes) -> bytes:
    """One request with ``Connection: close``; everything the sidecar answers (bounded)."""
    host, port = sc.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (target, headers, len(body), body)
    )
    await writer.drain()
    async with asyncio.timeout(10.0):
        data = await reader.read()
    writer.close()
    return data


@pytest.mark.parametrize("target", VARIANTS)
async def test_every_path_gets_the_key_check_and_the_decided_tenant(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, target: bytes
) -> None:
    """Issue 23, item 3: a path variant or an absolute-form target is no way around the
    key check, and the model server never sees a forged tenant header."""
    sc = await sidecar_factory(api_keys=KEYS)
    body = json.dumps(chat_body("through a side door")).encode()
    forged = b"X-Tenant-ID: beta\r\nX_Tenant_ID: beta\r\nx-tenant_id: beta\r\n"
    for auth in (b"", b"Authorization: Bearer sk-wrong\r\n"):
        refused = await send_raw(sc, target, auth + forged, body)
        assert refused.startswith(b"HTTP/1.1 401"), refused[:200]
        assert refused.count(b"HTTP/1.1 ") == 1
    assert sum(upstream.calls.values()) == 0  # nothing reached the model server
    assert await mismatches(sc, "missing_key") == 1
    assert await mismatches(sc, "invalid_key") == 1

    served = await send_raw(
        sc, target, b"Authorization: Bearer sk-alpha-0123456789\r\n" + forged, body
    )
    assert served.startswith(b"HTTP/1.1 200"), served[:200]
    seen = upstream.seen_headers[-1]
    assert seen["x-tenant-id"] == "alpha"  # the decided tenant, never the forged one
    assert not [
        name for name in seen if name.replace("_", "-") == "x-tenant-id" and name != "x-tenant-id"
    ]
    assert await mismatches(sc, "header_ignored") == 1


async def test_an_absolute_form_target_is_the_cached_endpoint_and_variants_are_not_cached(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(api_keys=KEYS)
    body = json.dumps(chat_body("absolute")).encode()
    alpha = b"Authorization: Bearer sk-alpha-0123456789\r\n"
    first = await send_raw(sc, b"http://evil/v1/chat/completions", alpha, body)
    assert b"x-cache: MISS" in first
    assert upstream.calls[CHAT] == 1  # sent as its path, not to "evil"
    canonical = await sc.chat("absolute", tenant=None, headers=ALPHA)
    assert canonical.headers["x-cache"] == "HIT-L1"  # one entry, one endpoint
    variant = await send_raw(sc, b"/v1//chat/completions", alpha, body)
    assert b"x-cache: BYPASS" in variant  # authenticated, passed through, never cached
    bad = await send_raw(sc, b"ftp://evil/v1/chat/completions", alpha, body)
    assert bad.startswith(b"HTTP/1.1 400"), bad[:200]
    assert upstream.calls[CHAT] == 1


async def test_header_mode_decides_every_path_too(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    untrusting = await sidecar_factory(trusted_proxies=())
    body = json.dumps(chat_body("q")).encode()
    for target in VARIANTS:
        raw = await send_raw(untrusting, target, b"X-Tenant-ID: beta\r\n", body)
        assert raw.startswith(b"HTTP/1.1 403"), raw[:200]
    assert sum(upstream.calls.values()) == 0
    trusting = await sidecar_factory(default_tenant="public", tenants=("public", "beta"))
    raw = await send_raw(trusting, b"/v1/models", b"X_Tenant_ID: beta\r\n", body)
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    assert upstream.seen_headers[-1]["x-tenant-id"] == "public"
    assert "x_tenant_id" not in upstream.seen_headers[-1]


async def test_status_names_tenants_only_to_127_0_0_1_and_not_to_a_mesh_peer(
    sidecar: RunningSidecar,
) -> None:
    """Issue 23, item 6: 127.0.0.6 is where Istio delivers mesh traffic, not an operator."""
    await sidecar.chat("q")
    host, port = sidecar.admin_url.removeprefix("http://").split(":")

    async def status_from(source: str) -> dict[str, object]:
        reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
        writer.write(b"GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        async with asyncio.timeout(10.0):
            raw = await reader.read()
        writer.close()
        doc: dict[str, object] = json.loads(raw.split(b"\r\n\r\n", 1)[1])
        return doc

    local = await status_from("127.0.0.1")
    assert "acme" in local["tenants"]  # type: ignore[operator]
    mesh = await status_from("127.0.0.6")
    assert "tenants" not in mesh
    assert "acme" not in json.dumps(mesh)
    assert mesh["tenant_count"] == 1


async def test_names_that_fold_to_the_tenant_header_never_reach_the_model_server(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    """Issue 23, item 6: servers that fold ``_`` into ``-`` would read ``X_Tenant_ID``."""
    sc = await sidecar_factory(api_keys=KEYS)
    forged = {"X_Tenant_ID": "beta", "x-Tenant_Id": "beta"}
    resp = await sc.chat("folded", tenant=None, headers={**ALPHA, **forged})
    assert resp.headers["x-cache"] == "MISS"
    seen = upstream.seen_headers[-1]
    assert seen["x-tenant-id"] == "alpha"
    assert sorted(name for name in seen if "tenant" in name) == ["x-tenant-id"]
