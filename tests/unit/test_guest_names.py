"""The guests' pool in Redis names: one slot, a key scope per guest, the pool's accounting apart."""

from __future__ import annotations

import re

import pytest

from cachefleet_common.contract.names import (
    GUESTS,
    entry_key,
    guest,
    guest_lru_key,
    guest_usage_key,
    l2_meta_keys,
    l2_versioned_keys,
    lru_key,
    own_lru_key,
    tenant_data_pattern,
    tenant_epochs_key,
    tenant_tombstone_key,
    usage_key,
    valid_name,
)

CACHE = "ns/chat"
DIGEST = "ab" * 32


def hashtag(key: str) -> str:
    found = re.search(r"\{([^}]*)\}", key)
    assert found is not None
    return found.group(1)


def test_a_listed_tenants_keys_are_as_before() -> None:
    assert entry_key(CACHE, "acme", DIGEST) == f"cf:{{cf:{CACHE}|acme}}:e:{DIGEST}"
    assert usage_key(CACHE, "acme") == f"cf:{{cf:{CACHE}|acme}}:usage"
    assert own_lru_key(CACHE, "acme") == lru_key(CACHE, "acme")


@pytest.mark.parametrize("name", ["p", "g", "usage", "lru", "acme"])
def test_every_guest_key_is_in_the_pools_slot_and_no_two_collide(name: str) -> None:
    assert not valid_name(guest(name))  # never taken for a tenant's own name
    keys = [*l2_versioned_keys(CACHE, guest(name), DIGEST), guest_usage_key(CACHE, name)]
    keys.append(guest_lru_key(CACHE, name))
    assert {hashtag(k) for k in keys} == {f"cf:{CACHE}|_guests"}
    # the pool's accounting and fence are every guest's; entries, tombstones and the
    # guest's own accounting are its own
    assert l2_meta_keys(CACHE, guest(name)) == l2_meta_keys(CACHE, GUESTS)
    fence = tenant_epochs_key(CACHE, guest(name))
    assert fence == tenant_epochs_key(CACHE, guest("other")) == tenant_epochs_key(CACHE, GUESTS)
    assert fence != tenant_epochs_key(CACHE, name)  # a listed namesake's is its own
    own = {
        entry_key(CACHE, guest(name), DIGEST),
        tenant_tombstone_key(CACHE, guest(name)),
        guest_usage_key(CACHE, name),
        guest_lru_key(CACHE, name),
    }
    others = {
        entry_key(CACHE, guest("other"), DIGEST),
        tenant_tombstone_key(CACHE, guest("other")),
        guest_usage_key(CACHE, "other"),
        guest_lru_key(CACHE, "other"),
    }
    assert len(own) == 4
    assert not own & others
    assert not own & {fence, *l2_meta_keys(CACHE, GUESTS)}
    assert own_lru_key(CACHE, guest(name)) == guest_lru_key(CACHE, name)
    assert own_lru_key(CACHE, guest(name)) != lru_key(CACHE, guest(name))


def test_the_operators_cleanup_pattern_covers_the_pool() -> None:
    pattern = tenant_data_pattern(CACHE).replace("\\", "")
    assert entry_key(CACHE, guest("x"), DIGEST).startswith(pattern.rstrip("*"))
