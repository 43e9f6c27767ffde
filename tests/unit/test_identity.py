"""The identity building blocks: the API-keys table and trusted networks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from cachefleet_sidecar.tenancy.identity import (
    ApiKeys,
    KeyFileError,
    TrustedNetworks,
    key_digest,
    parse_api_keys,
    parse_networks,
)


def test_plain_keys_and_digests_map_to_the_same_table() -> None:
    digest = hashlib.sha256(b"sk-two").hexdigest()
    table = parse_api_keys(json.dumps({"sk-one": "alpha", f"sha256:{digest}": "beta"}).encode())
    keys = ApiKeys(table)
    assert keys.lookup(b"sk-one") == "alpha"
    assert keys.lookup(b"sk-two") == "beta"
    assert keys.lookup(b"sha256:" + digest.encode()) is None  # a digest is not a key
    assert keys.lookup(b"sk-on") is None
    assert set(table) == {key_digest(b"sk-one"), bytes.fromhex(digest)}
    assert keys.tenants == {"alpha", "beta"}


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        (b"[1]", "JSON object"),
        (b"{not json", "not JSON"),
        (b'{"sk-secret-1": "no spaces"}', "entry 1: tenant"),
        (b'{"sk-secret-1": 7}', "entry 1: tenant"),
        (b'{"sha256:abc": "alpha"}', "64 hex digits"),
        (b'{"sha256:' + b"z" * 64 + b'": "alpha"}', "not hex"),
        (b'{"": "alpha"}', "non-empty"),
    ],
)
def test_bad_keys_files_are_refused_without_echoing_keys(doc: bytes, words: str) -> None:
    with pytest.raises(KeyFileError) as info:
        parse_api_keys(doc)
    assert words in str(info.value)
    assert "sk-secret" not in str(info.value)


def test_same_key_for_two_tenants_is_refused() -> None:
    digest = hashlib.sha256(b"sk-one").hexdigest()
    with pytest.raises(KeyFileError, match="two tenants"):
        parse_api_keys({"sk-one": "alpha", f"sha256:{digest}": "beta"})


def test_poll_reloads_only_on_change_and_keeps_old_keys_on_error(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text('{"k1": "alpha"}')
    keys = ApiKeys.from_file(str(path))
    assert keys.poll() is False
    path.write_text('{"k2": "beta", "k3": "beta"}')
    assert keys.poll() is True
    assert keys.lookup(b"k2") == "beta"
    assert keys.lookup(b"k1") is None
    path.write_text("{broken")
    assert keys.poll() is False
    assert keys.error is not None
    assert "not JSON" in keys.error
    assert keys.lookup(b"k2") == "beta"
    path.unlink()
    assert keys.poll() is False
    assert keys.lookup(b"k2") == "beta"


def test_trusted_networks() -> None:
    nets = TrustedNetworks(parse_networks("10.0.0.0/8, 127.0.0.1 ,fd00::/8"))
    assert nets.trusts("10.1.2.3")
    assert nets.trusts("127.0.0.1")
    assert not nets.trusts("127.0.0.2")
    assert nets.trusts("::ffff:10.9.9.9")  # IPv4-mapped, from a dual-stack socket
    assert nets.trusts("fd00::1")
    assert not nets.trusts("::1")
    assert not nets.trusts(None)
    assert not nets.trusts("not-an-ip")
    assert not TrustedNetworks(parse_networks("")).trusts("127.0.0.1")
    with pytest.raises(ValueError, match=r"10\.0\.0\.0/33"):
        parse_networks("10.0.0.0/33")
