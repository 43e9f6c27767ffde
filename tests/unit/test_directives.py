"""Request Cache-Control parsing (RFC 9111 5.2.1) and the price table (pure)."""

from __future__ import annotations

import pytest

from cachefleet_common.prices import PriceTableError, cost, parse_price_table
from cachefleet_sidecar.cache.directives import Allowed, Directives, parse


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (b"", Directives()),
        (b"No-Cache", Directives(no_cache=True)),
        (b"no-store, max-age=30", Directives(no_store=True, max_age=30)),
        (b'max-age="12"', Directives(max_age=12)),
        (b"max-age=60, max-age=5", Directives(max_age=5)),  # the strictest wins
        (b"max-age=abc, max-age=", Directives()),  # malformed: ignored
        (b"max-age=-1", Directives()),
        (b"max-age=99999999999999999999", Directives(max_age=2**31)),
        (b" only-if-cached ,private", Directives(only_if_cached=True)),
        (b"no-cache=set-cookie", Directives(no_cache=True)),
    ],
)
def test_directives(header: bytes, expected: Directives) -> None:
    assert parse(header) == expected


def test_disallowed_directives_are_dropped_and_named() -> None:
    header = b"no-cache, no-store, max-age=30, only-if-cached"
    assert parse(header, Allowed(bypass=False)) == Directives(
        max_age=30, only_if_cached=True, ignored=("no-cache", "no-store")
    )
    assert parse(header, Allowed(max_age=False)) == Directives(
        no_cache=True, no_store=True, only_if_cached=True, ignored=("max-age",)
    )
    assert parse(b"only-if-cached", Allowed(False, False)).ignored == ()


@pytest.mark.parametrize(
    ("header", "allowed", "expected"),
    [
        (b"max-age=0", Allowed(), Directives(no_cache=True)),
        (b"max-age=0", Allowed(max_age=False), Directives(no_cache=True)),
        (b"max-age=0", Allowed(bypass=False), Directives(ignored=("max-age",))),
        (b'max-age="0", max-age=60', Allowed(bypass=False), Directives(ignored=("max-age",))),
        (b"max-age=1", Allowed(bypass=False), Directives(max_age=1)),
        (
            b"only-if-cached, max-age=0",
            Allowed(bypass=False),
            Directives(only_if_cached=True, ignored=("max-age",)),
        ),
    ],
)
def test_max_age_zero_is_a_bypass_under_the_bypass_allowance(
    header: bytes, allowed: Allowed, expected: Directives
) -> None:
    """Issue 34 (7): no entry is 0 s old when read, so ``max-age=0`` is ``no-cache``: a
    tenant that may not bypass had it obeyed anyway (3 model calls for 3 requests)."""
    assert parse(header, allowed) == expected


def test_price_table() -> None:
    table = parse_price_table(b'{"m1": {"prompt": 1, "completion": 2.5}, "*": {"prompt": 0.5}}')
    assert table == {"m1": (1.0, 2.5), "*": (0.5, 0.0)}
    assert cost(table, "m1", 1000, 2000) == 1.0 + 5.0
    assert cost(table, "other", 2000, 10) == 1.0
    assert cost({"m1": (1.0, 1.0)}, "other", 10, 10) is None
    for bad, says in (
        (b"[]", "JSON object"),
        (b"{", "not JSON"),
        (b'{"m": {"prompt": "1"}}', "'m'.prompt: must be a number"),
        (b'{"m": {"input": 1}}', "only 'prompt' and 'completion'"),
        (b'{"m": {"completion": -0.5}}', "finite number >= 0"),
    ):
        with pytest.raises(PriceTableError, match=says):
            parse_price_table(bad)
