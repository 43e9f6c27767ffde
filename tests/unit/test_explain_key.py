"""``kubectl cachefleet explain-key`` on real request bodies, through the command line."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from cachefleet_common import keys
from cachefleet_operator.kubectl_plugin import cli, explain

CHAT = {
    "model": "llama-3-8b",
    "messages": [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "temperature": 0,
    "max_tokens": 64,
}
# the same request as another client writes it: other field order and formatting, 0.0
# for 0, a user id and metadata (never change the answer), "stream": false spelled out
CHAT_AGAIN = (
    b'{\n  "max_tokens": 64, "stream": false, "user": "u-42", "metadata": {"trace": "x"},\n'
    b'  "messages": [{"content": "You answer in one sentence.", "role": "system"},\n'
    b'               {"content": "What is the capital of France?", "role": "user"}],\n'
    b'  "temperature": 0.0, "model": "llama-3-8b"}'
)


def _run(argv: list[str], stdin: bytes = b"") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()

    class _Stdin:
        buffer = io.BytesIO(stdin)

    code = cli.main(["explain-key", *argv], out=out, err=err, stdin=_Stdin())
    return code, out.getvalue(), err.getvalue()


def _write(tmp_path: Path, name: str, body: Any) -> str:
    path = tmp_path / name
    path.write_bytes(body if isinstance(body, bytes) else json.dumps(body).encode())
    return str(path)


def test_two_spellings_of_one_request_share_an_entry(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.json", CHAT)
    b = _write(tmp_path, "b.json", CHAT_AGAIN)
    code, out, _ = _run([a, b])
    assert code == 0
    digest = explain.digest_hex(
        keys.make_key(CHAT, "chat", keys.Scope(explain.DEFAULT_TENANT))
    )  # what the sidecar's keying gives the first body
    assert f"{a} and {b} share one cache entry (digest {digest})" in out
    assert out.count(f"digest:         {digest}") == 2
    # the canonical form shows why: sorted fields, 0.0, stream false, no user/metadata
    assert '"stream":false,"temperature":0.0}' in out
    assert "u-42" not in out


def test_a_differing_field_is_named_with_both_values(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.json", CHAT)
    b = _write(tmp_path, "b.json", {**CHAT, "max_tokens": 65})
    code, out, _ = _run([a, b, "-o", "json"])
    assert code == 0
    verdict = json.loads(out)["comparison"]
    assert verdict["shared"] is False
    assert verdict["difference"]["field"] == "max_tokens"
    assert (verdict["difference"]["left"], verdict["difference"]["right"]) == ("64", "65")
    code, text, _ = _run([a, b])
    assert f"{a} and {b} do NOT share a cache entry: first difference at max_tokens" in text


def test_whitespace_in_a_message_differs_unless_the_tenant_collapses_it(tmp_path: Path) -> None:
    question = {"role": "user", "content": "What  is the capital of France? "}
    spaced = {**CHAT, "messages": [CHAT["messages"][0], question]}  # type: ignore[index]
    a = _write(tmp_path, "a.json", CHAT)
    b = _write(tmp_path, "b.json", spaced)
    _, out, _ = _run([a, b])
    assert "first difference at messages[1].content" in out
    assert '"What  is the capital of France? "' in out
    _, out, _ = _run([a, b, "--collapse-whitespace"])
    assert "share one cache entry" in out


def test_a_body_the_sidecar_would_not_cache_says_why(tmp_path: Path) -> None:
    sampled = _write(tmp_path, "sampled.json", {**CHAT, "temperature": 0.7})
    code, out, _ = _run([sampled])
    assert code == 0
    assert "cacheable:      no: not deterministic (temperature != 0 and no seed)" in out
    assert "digest:" not in out
    # the tenant option cacheNondeterministic widens what is cached
    assert "cacheable:      yes" in _run([sampled, "--cache-nondeterministic"])[1]
    duplicate = _write(tmp_path, "dup.json", b'{"model": "m", "model": "n", "temperature": 0}')
    assert "no: body is not an unambiguous JSON object" in _run([duplicate])[1]
    stream = _write(tmp_path, "stream.json", {**CHAT, "stream": "yes"})
    assert 'no: "stream" is not a boolean' in _run([stream])[1]
    a = _write(tmp_path, "a.json", CHAT)
    _, out, _ = _run([a, sampled])
    assert f"do NOT share a cache entry: {sampled} is not cached: not deterministic" in out


def test_other_endpoints_and_query_strings(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.json", CHAT)
    _, out, _ = _run([a, "--path", "/v1/models"])
    assert "no: not a cached endpoint (cached: /v1/chat/completions, /v1/completions" in out
    emb = _write(tmp_path, "emb.json", {"model": "e5", "input": "hello"})
    _, out, _ = _run([emb, "--path", "/v1/embeddings?api-version=2"])
    assert "/v1/embeddings?api-version=2 (embeddings)" in out
    assert "cacheable:      yes" in out
    doc = json.loads(_run([emb, "--path", "/v1/embeddings?api-version=2", "-o", "json"])[1])
    plain = json.loads(_run([emb, "--path", "/v1/embeddings", "-o", "json"])[1])
    assert doc["requests"][0]["digest"] != plain["requests"][0]["digest"]


def test_stdin_tenant_version_and_epochs_change_the_digest_not_the_sharing(
    tmp_path: Path,
) -> None:
    a = _write(tmp_path, "a.json", CHAT)

    def digest(*flags: str) -> str:
        code, out, _ = _run(["-", "-o", "json", *flags], stdin=json.dumps(CHAT).encode())
        assert code == 0
        found: str = json.loads(out)["requests"][0]["digest"]
        return found

    base = digest()
    assert digest("--tenant", "other") != base
    assert digest("--model-version", "v2") != base
    assert digest("--epochs", "0,0,0") != base  # a sidecar with Redis keys with epochs
    _, out, _ = _run([a, "-", "--tenant", "other", "--epochs", "1,2,3"], stdin=CHAT_AGAIN)
    assert "share one cache entry" in out


def test_bad_arguments_name_the_flag_or_file(tmp_path: Path) -> None:
    code, _, err = _run([str(tmp_path / "missing.json")])
    assert code == cli.EXIT_USAGE
    assert "missing.json" in err
    code, _, err = _run(["-", "--epochs", "1,2"])
    assert code == cli.EXIT_USAGE
    assert "--epochs" in err


def test_a_body_too_large_to_key(tmp_path: Path) -> None:
    size = keys.MAX_KEYED_BODY_BYTES + 1
    big = _write(tmp_path, "big.json", b'{"model": "m", "prompt": "' + b"x" * size + b'"}')
    assert "cacheable:      no: body too large to key" in _run([big])[1]


def test_a_cache_namespace_changes_the_digest_not_the_sharing(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.json", CHAT)
    b = _write(tmp_path, "b.json", CHAT_AGAIN)
    code, out, _ = _run([a, "--tenant", "acme", "--namespace-value", "kb-billing"])
    assert code == 0
    # the sidecar's keying of a request with X-Cache-Namespace: kb-billing
    key = keys.make_key(CHAT, "chat", keys.Scope("acme", namespace="kb-billing"))
    assert "namespace:      kb-billing" in out
    assert f"sha256:         {key.sha256_hex}  (X-Cache-Key: the L2 entry in Redis)" in out
    # a line to paste: the purge of this very entry
    assert (
        f"purge it:       kubectl cachefleet invalidate CACHE --scope key --key {key.sha256_hex}"
        in out
    )
    plain = keys.make_key(CHAT, "chat", keys.Scope("acme"))
    assert plain.sha256_hex != key.sha256_hex
    assert "namespace:      (none: no X-Cache-Namespace header)" in _run([a, "--tenant", "acme"])[1]
    _, out, _ = _run([a, b, "--namespace-value", "kb-billing"])
    assert "share one cache entry" in out
    doc = json.loads(_run([a, "--namespace-value", "kb-billing", "-o", "json"])[1])
    assert doc["requests"][0]["namespace"] == "kb-billing"


def test_output_key_prints_only_the_x_cache_key(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.json", CHAT)
    b = _write(tmp_path, "b.json", {**CHAT, "max_tokens": 65})
    code, out, err = _run([a, b, "-o", "key", "--tenant", "acme", "--namespace-value", "kb"])
    assert (code, err) == (0, "")
    scope = keys.Scope("acme", namespace="kb")
    assert out.splitlines() == [
        keys.make_key(CHAT, "chat", scope).sha256_hex,
        keys.make_key({**CHAT, "max_tokens": 65}, "chat", scope).sha256_hex,
    ]
    sampled = _write(tmp_path, "s.json", {**CHAT, "temperature": 0.7})
    code, out, err = _run([sampled, "-o", "key"])
    assert (code, out) == (cli.EXIT_ERROR, "")
    assert f"{sampled} is not cached, so it has no X-Cache-Key: not deterministic" in err


def test_namespace_epochs_and_bad_namespaces(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.json", CHAT)
    # a sidecar with Redis keys a namespaced request by four epochs, the namespace's last
    code, out, _ = _run([a, "-o", "key", "--namespace-value", "kb", "--epochs", "0,1,2,3"])
    assert code == 0
    scope = keys.Scope(explain.DEFAULT_TENANT, "", (0, 1, 2, 3), "kb")
    assert out.strip() == keys.make_key(CHAT, "chat", scope).sha256_hex
    code, _, err = _run([a, "--namespace-value", "kb", "--epochs", "0,1,2"])
    assert code == cli.EXIT_USAGE
    assert err == (
        "error: --epochs '0,1,2': 4 integers (cache, tenant, model, namespace), e.g. 0,2,1,3\n"
    )
    code, _, err = _run([a, "--epochs", "0,1,2,3"])
    assert (code, err) == (
        cli.EXIT_USAGE,
        "error: --epochs '0,1,2,3': 3 integers (cache, tenant, model), e.g. 0,2,1\n",
    )
    # what the sidecar answers 400 to
    for bad in ("kb billing", "-kb", "x" * 64):
        code, _, err = _run([a, f"--namespace-value={bad}"])
        assert code == cli.EXIT_USAGE
        assert err.startswith(f"error: --namespace-value {bad!r}: 1-63 of [A-Za-z0-9._-]")


def test_a_tenant_the_sidecar_would_refuse_is_a_usage_error(tmp_path: Path) -> None:
    """Issue 34 (8): ``--tenant 'a/b'`` (also ``''`` and 70 characters) printed a digest, and
    ``a/b`` the same one as tenant ``a`` in namespace ``b``. The sidecar's own rule
    (:func:`cachefleet_common.contract.names.valid_name`) decides, as for its header."""
    a = _write(tmp_path, "a.json", CHAT)
    for bad in ("a/b", "", "x" * 70, "x" * 64, "-a", "a b", "a\n", "ténant"):
        code, out, err = _run([a, "-o", "key", f"--tenant={bad}"])
        assert (code, out) == (cli.EXIT_USAGE, ""), bad
        assert err == f"error: --tenant {bad!r}: {cli.NAME_RULE}\n"
    for good in ("a", "x" * 63, "Team_1.prod-2"):
        code, out, _ = _run([a, "-o", "key", f"--tenant={good}"])
        assert code == 0, good
        assert out.strip() == keys.make_key(CHAT, "chat", keys.Scope(good, "", ())).sha256_hex
