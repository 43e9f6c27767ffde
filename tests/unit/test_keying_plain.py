"""The fast path's keying without a :class:`Lookup` (:meth:`Keying.plain`): the same
tenant, key, namespace and scope version as :meth:`Keying.lookup`, and the
``Lookup`` itself for every request an L1 hit cannot answer at once. No sockets."""

from __future__ import annotations

import json

import pytest

from cachefleet_sidecar.cache.keying import Keying, Lookup
from cachefleet_sidecar.compose import build
from cachefleet_sidecar.config import SidecarConfig
from cachefleet_sidecar.http.server import Refusal, Request

BODY = json.dumps(
    {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
).encode()


def keying() -> Keying:
    config = SidecarConfig.from_flat(cache="ns/c", admin_listen=None, default_tenant="dflt")
    return build(config).keying


def request(*headers: tuple[bytes, bytes], body: bytes = BODY) -> Request:
    return Request(b"POST", b"/v1/chat/completions", list(headers), body, True, 0.0, "10.0.0.1")


@pytest.mark.parametrize(
    "headers",
    [
        (),
        ((b"x-cache-namespace", b"team-a"),),
        ((b"host", b"x"), (b"x-cache-namespace", b"team-a"), (b"x-cache-namespace", b"team-b")),
    ],
)
def test_a_plain_request_gets_the_tenant_key_namespace_and_version_of_its_lookup(
    headers: tuple[tuple[bytes, bytes], ...],
) -> None:
    k = keying()
    found = k.plain(request(*headers), "chat", b"")
    assert isinstance(found, tuple)
    lookup = k.lookup(request(*headers), "chat", b"")
    assert found == (lookup.tenant, lookup.key, lookup.namespace, lookup.version)
    assert found[0] == "dflt"
    assert found[2] == ("team-a" if headers else "")  # the first namespace header counts


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        (((b"cache-control", b"no-cache"),), BODY),
        (((b"cache-control", b"max-age=5"), (b"cache-control", b"no-store")), BODY),
        ((), b"not json"),
    ],
)
def test_any_other_request_gets_its_lookup(
    headers: tuple[tuple[bytes, bytes], ...], body: bytes
) -> None:
    k = keying()
    found = k.plain(request(*headers, body=body), "chat", b"")
    assert isinstance(found, Lookup)
    assert found == k.lookup(request(*headers, body=body), "chat", b"")


def test_a_bad_namespace_is_refused_as_by_lookup() -> None:
    k = keying()
    bad = (b"x-cache-namespace", b"no spaces/allowed")
    with pytest.raises(Refusal) as plain:
        k.plain(request(bad), "chat", b"")
    with pytest.raises(Refusal) as full:
        k.lookup(request(bad), "chat", b"")
    assert plain.value.response() == full.value.response()
