"""The running router's readiness: not ready until discovery has said what the endpoints are."""

from __future__ import annotations

import grpc
import httpx

from cachefleet_router.health import (
    HealthCheckRequest,
    HealthCheckResponse,
    HealthListRequest,
    HealthListResponse,
)
from cachefleet_router.server import RouterConfig, RouterServer

from .conftest import Gateway, headers_message

SERVING, NOT_SERVING = 1, 2


async def test_not_ready_while_the_api_server_cannot_be_read() -> None:
    # An API server that never answers: the pool can never be listed.
    unreachable = httpx.AsyncClient(base_url="http://127.0.0.1:1", timeout=1.0)
    router = RouterServer(
        RouterConfig(
            grpc_listen=("127.0.0.1", 0),
            metrics_listen=("127.0.0.1", 0),
            pool_name="llm",
            scrape_interval_s=0,
        ),
        kube_client=unreachable,
    )
    await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}")
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.metrics_port}")
    try:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString,
        )
        status = {
            name: (await check(HealthCheckRequest(service=name))).status
            for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
        }
        assert status == {
            "liveness": SERVING,
            "readiness": NOT_SERVING,
            "envoy.service.ext_proc.v3.ExternalProcessor": NOT_SERVING,
        }
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/readyz")).status_code == 503
        # A request that still arrives gets the protocol's answer, not a hang.
        [answer] = await Gateway(channel).exchange([headers_message(end_of_stream=True)], 1)
        assert answer.immediate_response.status.code == 503
    finally:
        await channel.close()
        await http.aclose()
        await router.stop(0)
        await unreachable.aclose()
    assert router.health.status("liveness") == NOT_SERVING  # stopped: nothing is served


async def test_health_watch_streams_the_status() -> None:
    router = RouterServer(
        RouterConfig(
            grpc_listen=("127.0.0.1", 0),
            metrics_listen=None,
            endpoints=("127.0.0.1:1",),
            scrape_interval_s=0,
        )
    )
    await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}")
    try:
        watch = channel.unary_stream(
            "/grpc.health.v1.Health/Watch",
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString,
        )
        ready = watch(HealthCheckRequest(service="readiness"))
        assert (await ready.read()).status == SERVING
        ready.cancel()
        unknown = watch(HealthCheckRequest(service="nope"))
        assert (await unknown.read()).status == 3  # SERVICE_UNKNOWN
        unknown.cancel()
    finally:
        await channel.close()
        await router.stop(0)


async def test_health_list_names_every_service_with_its_status() -> None:
    unreachable = httpx.AsyncClient(base_url="http://127.0.0.1:1", timeout=1.0)
    router = RouterServer(
        RouterConfig(
            grpc_listen=("127.0.0.1", 0),
            metrics_listen=None,
            pool_name="llm",
            scrape_interval_s=0,
        ),
        kube_client=unreachable,
    )
    await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}")
    try:
        listing = channel.unary_unary(
            "/grpc.health.v1.Health/List",
            request_serializer=HealthListRequest.SerializeToString,
            response_deserializer=HealthListResponse.FromString,
        )
        answer = await listing(HealthListRequest())
        assert {name: s.status for name, s in answer.statuses.items()} == {
            "": NOT_SERVING,  # the pool cannot be read: not ready
            "liveness": SERVING,
            "readiness": NOT_SERVING,
            "envoy.service.ext_proc.v3.ExternalProcessor": NOT_SERVING,
        }
    finally:
        await channel.close()
        await router.stop(0)
        await unreachable.aclose()
