"""The tenant rules (docs/security.md) without sockets: headers and a peer in, a tenant or a refusal
out."""

from __future__ import annotations

import pytest

from cachefleet_sidecar.http.server import Refusal
from cachefleet_sidecar.tenancy.identity import (
    TENANT_MEMO_MAX,
    ApiKeys,
    TenantRules,
    TrustedNetworks,
    parse_api_keys,
    parse_networks,
)

PROXY = "10.0.0.7"
OUTSIDER = "192.0.2.9"
Headers = list[tuple[bytes, bytes]]


def tenant(value: str) -> Headers:
    return [(b"content-type", b"application/json"), (b"x-tenant-id", value.encode())]


def bearer(key: str) -> tuple[bytes, bytes]:
    return (b"authorization", b"Bearer " + key.encode())


class Counted:
    """What the rules count as identity mismatches."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)


def header_rules(counted: Counted | None = None, **kw: object) -> TenantRules:
    return TenantRules(
        "X-Tenant-ID",
        trusted=TrustedNetworks(parse_networks("10.0.0.0/8")),
        on_mismatch=counted,
        **kw,  # type: ignore[arg-type]
    )


def key_rules(counted: Counted | None = None, **kw: object) -> TenantRules:
    keys = ApiKeys(parse_api_keys({"key-acme": "acme", "key-beta": "beta"}))
    return TenantRules(
        "X-Tenant-ID",
        api_keys=keys,
        trusted=TrustedNetworks(parse_networks("10.0.0.0/8")),
        on_mismatch=counted,
        **kw,  # type: ignore[arg-type]
    )


def refused(rules: TenantRules, headers: Headers, peer: str | None = PROXY) -> Refusal:
    with pytest.raises(Refusal) as caught:
        rules.resolve(headers, peer)
    return caught.value


# ---------------------------------------------------------------- API keys


def test_with_keys_the_key_alone_decides_and_a_forged_header_is_dropped_and_counted() -> None:
    counted = Counted()
    rules = key_rules(counted)
    assert rules.resolve([bearer("key-acme")], OUTSIDER) == "acme"
    assert counted.reasons == []
    # The header names someone else: ignored (the key decides, from any peer), counted.
    assert rules.resolve([*tenant("beta"), bearer("key-acme")], PROXY) == "acme"
    assert rules.resolve([*tenant("beta"), bearer("key-acme")], OUTSIDER) == "acme"
    assert counted.reasons == ["header_ignored", "header_ignored"]
    # A header that agrees with the key is not a mismatch.
    assert rules.resolve([*tenant("acme"), bearer("key-acme")], PROXY) == "acme"
    assert counted.reasons == ["header_ignored", "header_ignored"]


@pytest.mark.parametrize(
    ("auth", "reason"),
    [
        (None, "missing_key"),
        (b"Bearer key-nobody", "invalid_key"),
        (b"Basic a2V5LWFjbWU=", "invalid_key"),
        (b"key-acme", "invalid_key"),
    ],
)
def test_with_keys_a_missing_or_wrong_key_is_a_401_that_asks_for_a_bearer_key(
    auth: bytes | None, reason: str
) -> None:
    counted = Counted()
    headers = tenant("acme") + ([(b"authorization", auth)] if auth is not None else [])
    refusal = refused(key_rules(counted), headers)
    assert refusal.status == 401
    assert b'www-authenticate: Bearer realm="cachefleet"' in refusal.extra
    assert "key-" not in refusal.reason  # a key never appears in a message
    assert counted.reasons == [reason]
    assert refusal.response().startswith(b"HTTP/1.1 401 ")


def test_with_keys_the_default_tenant_is_only_for_keyless_requests() -> None:
    rules = key_rules(default_tenant="public")
    assert rules.resolve([], OUTSIDER) == "public"
    assert rules.resolve(tenant("acme"), PROXY) == "public"  # a header alone is no key
    assert rules.resolve([bearer("key-beta")], OUTSIDER) == "beta"
    assert refused(rules, [bearer("key-nobody")]).status == 401  # a wrong key is not keyless


def test_a_key_file_reload_is_followed() -> None:
    keys = ApiKeys(parse_api_keys({"key-acme": "acme"}))
    rules = TenantRules("X-Tenant-ID", api_keys=keys)
    assert rules.resolve([bearer("key-acme")], None) == "acme"
    keys.table = parse_api_keys({"key-acme": "beta"})  # what ApiKeys.poll installs
    assert rules.resolve([bearer("key-acme")], None) == "beta"


# ---------------------------------------------------------------- the tenant header


def test_the_header_is_believed_only_from_trusted_networks() -> None:
    counted = Counted()
    rules = header_rules(counted)
    assert rules.resolve(tenant("acme"), PROXY) == "acme"
    assert rules.resolve(tenant("acme"), "::ffff:10.1.2.3") == "acme"  # v4-mapped v6
    for peer in (OUTSIDER, "::1", None):
        refusal = refused(rules, tenant("acme"), peer)
        assert refusal.status == 403
        assert "--trusted-proxies" in refusal.reason
    assert counted.reasons == ["untrusted_header"] * 3


def test_without_trusted_networks_no_header_is_believed() -> None:
    rules = TenantRules("X-Tenant-ID", default_tenant="public")
    assert refused(rules, tenant("acme"), "127.0.0.1").status == 403
    assert rules.resolve([], "127.0.0.1") == "public"


def test_without_a_header_the_default_tenant_or_a_403_naming_the_header() -> None:
    assert header_rules(default_tenant="public").resolve([], OUTSIDER) == "public"
    refusal = refused(TenantRules("X-Team"), [])
    assert refusal.status == 403
    assert "X-Team" in refusal.reason


def test_a_custom_header_name_is_matched_as_the_server_lowercases_it() -> None:
    rules = TenantRules("X-Team", trusted=TrustedNetworks(parse_networks("10.0.0.0/8")))
    assert rules.resolve([(b"x-team", b"acme")], PROXY) == "acme"
    # The default header name means nothing here.
    assert refused(rules, tenant("acme")).status == 403


@pytest.mark.parametrize("value", ["", "-lead", "a b", "x" * 64, "acme/other", "é"])
def test_an_invalid_tenant_name_is_a_400(value: str) -> None:
    refusal = refused(header_rules(), [(b"x-tenant-id", value.encode())])
    assert refusal.status == 400
    assert "invalid tenant name" in refusal.reason


def test_the_identity_header_given_twice() -> None:
    counted = Counted()
    rules = header_rules(counted)
    # The same value twice is one claim.
    assert rules.resolve(tenant("acme") + tenant("acme"), PROXY) == "acme"
    refusal = refused(rules, tenant("acme") + tenant("beta"))
    assert refusal.status == 400
    assert "more than one X-Tenant-ID header" in refusal.reason
    assert counted.reasons == ["ambiguous"]


def test_two_different_authorization_headers_are_ambiguous_only_with_keys() -> None:
    counted = Counted()
    two_keys = [bearer("key-acme"), bearer("key-beta")]
    refusal = refused(key_rules(counted), two_keys)
    assert (refusal.status, counted.reasons) == (400, ["ambiguous"])
    # Without a keys table Authorization is the model server's business.
    assert header_rules().resolve(tenant("acme") + two_keys, PROXY) == "acme"


# ---------------------------------------------------------------- known tenants and guests


def test_with_known_tenants_an_unlisted_name_is_refused_or_sent_to_the_default() -> None:
    rules = header_rules(known=("alpha", "beta"))
    assert rules.resolve(tenant("alpha"), PROXY) == "alpha"
    refusal = refused(rules, tenant("gamma"))
    assert (refusal.status, refusal.reason) == (403, "unknown tenant 'gamma'")
    with_default = header_rules(known=("alpha",), default_tenant="public")
    assert with_default.resolve(tenant("gamma"), PROXY) == "public"
    assert with_default.resolve(tenant("alpha"), PROXY) == "alpha"


def test_without_known_tenants_any_valid_name_is_a_tenant() -> None:
    rules = header_rules(default_tenant="public")
    assert rules.resolve(tenant("anyone-1"), PROXY) == "anyone-1"


def test_guests_keep_their_own_name_when_admitted() -> None:
    rules = header_rules(known=("alpha",), default_tenant="public", admit_guests=True)
    assert rules.resolve(tenant("gamma"), PROXY) == "gamma"


def test_new_known_tenants_replace_remembered_decisions() -> None:
    rules = header_rules(known=("alpha",), admit_guests=True)
    assert rules.resolve(tenant("gamma"), PROXY) == "gamma"  # a guest, remembered
    # The operator's quotas move: no guests any more, gamma unlisted.
    rules.set_known(("alpha", "beta"), admit_guests=False)
    assert refused(rules, tenant("gamma")).status == 403
    assert rules.resolve(tenant("beta"), PROXY) == "beta"
    assert rules.known == {"alpha", "beta"}


def test_remembered_decisions_are_bounded() -> None:
    rules = header_rules()
    for i in range(TENANT_MEMO_MAX + 50):
        assert rules.resolve(tenant(f"t{i}"), PROXY) == f"t{i}"
    assert len(rules.memo) == TENANT_MEMO_MAX
    # Past the bound names are still decided, each time by the rules.
    assert rules.resolve(tenant(f"t{TENANT_MEMO_MAX + 10}"), PROXY) == f"t{TENANT_MEMO_MAX + 10}"
    assert refused(rules, [(b"x-tenant-id", b"bad name")]).status == 400
