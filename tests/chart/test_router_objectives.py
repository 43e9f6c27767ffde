"""The chart's ``router.objectives``: GIE objective names -> classes, as the picker's flag."""

from __future__ import annotations

import pytest

from cachefleet_router.cli import parse_args

from .test_chart import render
from .test_router import ROUTER, container


def test_objectives_reach_the_picker_as_one_flag_it_parses() -> None:
    objectives = {"nightly-batch": "BestEffort", "chat": "Standard"}
    args = container({"router": {**ROUTER, "objectives": objectives}})["args"]
    (flag,) = [a for a in args if a.startswith("--objectives=")]
    assert flag == "--objectives=chat=Standard,nightly-batch=BestEffort"
    config, _ = parse_args(["--endpoints", "a:1", flag])
    assert config.objectives == objectives
    assert not [a for a in container({"router": ROUTER})["args"] if "objectives" in a]


@pytest.mark.parametrize(
    ("objectives", "needle"),
    [
        ({"batch": "Platinum"}, "objectives"),
        ({"bad name": "BestEffort"}, "bad name"),
        ({"batch": 3}, "objectives"),
    ],
)
def test_the_schema_refuses_a_bad_objective(objectives: dict[str, object], needle: str) -> None:
    with pytest.raises(Exception, match="values don't meet the specifications") as info:
        render({"router": {**ROUTER, "objectives": objectives}})
    assert needle in str(info.value)
