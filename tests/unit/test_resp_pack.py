"""RESP packing: a command packed in parts is the same bytes as packed whole."""

from __future__ import annotations

import hiredis
import pytest

from cachefleet_common import resp


@pytest.mark.parametrize(
    ("keys", "args"),
    [
        (["cf:{t}:e:ab", "cf:{t}:lru", "cf:{t}:usage"], ["1", "cache=0"]),
        (["k\u00e9y:{t\u00e9}:e:0", *[f"k{i}" for i in range(11)]], [str(i) for i in range(9)]),
        (["only"], ["x"]),
    ],
)
def test_pack_script_is_the_whole_command(keys: list[str], args: list[str]) -> None:
    script = resp.Script("return KEYS[1]")
    rest = resp.pack_args([*keys[1:], *args])
    whole = hiredis.pack_command((b"EVALSHA", script.sha, len(keys), *keys, *args))
    assert resp.pack_script(script, len(keys), keys[0], rest) == whole
