"""GIE's ``x-gateway-inference-objective`` in the router: it lowers a class, never raises it."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_router.cli import parse_args
from cachefleet_router.prompt import reduce_request
from cachefleet_router.server import RouterConfig, RouterServer
from cachefleet_router.tenants import TenantClasses

from .conftest import Gateway, body_message, headers_message
from .test_extproc import RecordingPicker

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
CLASSES = {"gold": "Guaranteed", "silver": "Standard", "free": "BestEffort"}
OBJECTIVES = {"batch": "BestEffort", "vip": "Guaranteed", "normal": "Standard"}


def table(generation: int, objectives: dict[str, str]) -> QuotaAssignment:
    return QuotaAssignment(
        generation=generation,
        tenants={
            t: TenantQuota(l1_bytes=1, l2_bytes=0, priority_class=c)  # type: ignore[arg-type]
            for t, c in CLASSES.items()
        },
        objectives=objectives,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("tenant", "objective", "expected"),
    [
        ("gold", "batch", "BestEffort"),
        ("gold", "normal", "Standard"),
        ("gold", "vip", "Guaranteed"),
        ("silver", "vip", "Standard"),  # a forged objective does not raise it
        ("free", "vip", "BestEffort"),
        ("walk-in", "vip", None),  # no class (Standard) stays Standard
        ("walk-in", "batch", "BestEffort"),
        ("gold", "no-such-objective", "Guaranteed"),
        ("gold", "", "Guaranteed"),
    ],
)
def test_an_objective_lowers_the_tenants_class(
    tenant: str, objective: str, expected: str | None
) -> None:
    headers = {"x-tenant-id": tenant, "X-Gateway-Inference-Objective": objective}
    req = reduce_request(BODY, headers, class_of=CLASSES.get, objective_class=OBJECTIVES.get)
    assert req.priority_class == expected
    assert reduce_request(BODY, headers, class_of=CLASSES.get).priority_class == CLASSES.get(
        tenant
    )  # without a table, the header is not read


def test_the_quota_tables_objectives_go_over_the_flags() -> None:
    classes = TenantClasses({"batch": "BestEffort", "night": "BestEffort"})
    assert classes.objective_class("batch") == "BestEffort"
    assert classes.apply(table(1, {"batch": "Standard"}))
    assert classes.objective_class("batch") == "Standard"
    assert classes.objective_class(" night ") == "BestEffort"
    assert classes.apply(table(2, {}))  # the operator dropped it: the flag's again
    assert classes.objective_class("batch") == "BestEffort"
    assert classes.objective_class("other") is None


def test_the_objectives_flag(capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = parse_args(
        ["--endpoints", "a:1", "--objectives", "batch=BestEffort, vip=Guaranteed"]
    )
    assert config.objectives == {"batch": "BestEffort", "vip": "Guaranteed"}
    with pytest.raises(SystemExit) as exited:
        parse_args(["--endpoints", "a:1", "--objectives", "batch=Platinum"])
    assert exited.value.code == 2
    assert "--objectives: batch: the class must be one of" in capsys.readouterr().err


async def test_the_router_hands_the_lowered_class_to_the_picker() -> None:
    picker = RecordingPicker()
    router = RouterServer(
        RouterConfig(
            grpc_listen=("127.0.0.1", 0),
            metrics_listen=None,
            endpoints=("127.0.0.1:1",),
            scrape_interval_s=0,
            objectives={"batch": "BestEffort", "vip": "Guaranteed"},
        ),
        picker=picker,
    )
    await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}")
    try:
        gw = Gateway(channel)
        for objective in ("batch", "vip"):
            headers = {"x-tenant-id": "walk-in", "x-gateway-inference-objective": objective}
            await asyncio.wait_for(
                gw.exchange([headers_message(headers), body_message(BODY, end_of_stream=True)], 2),
                20.0,
            )
        assert [(r.tenant, r.priority_class) for r in picker.requests] == [
            ("walk-in", "BestEffort"),
            ("walk-in", None),
        ]
    finally:
        await channel.close()
        await router.stop(0)


def test_repeated_objective_headers_each_lower_the_class() -> None:
    """A client's own objective header beside the gateway's cannot undo the gateway's."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from cachefleet_router.extproc import _header_map

    raw = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key="x-tenant-id", raw_value=b"gold"),
                base_pb2.HeaderValue(key="x-gateway-inference-objective", raw_value=b"batch"),
                base_pb2.HeaderValue(key="X-Gateway-Inference-Objective", raw_value=b"vip"),
            ]
        )
    )
    headers = _header_map(raw)
    assert headers["x-gateway-inference-objective"] == "batch,vip"
    req = reduce_request(BODY, headers, class_of=CLASSES.get, objective_class=OBJECTIVES.get)
    assert req.priority_class == "BestEffort"
