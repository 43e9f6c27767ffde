"""Router test fixtures: a gRPC client playing the gateway, vLLM-like /metrics servers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from cachefleet_router.extproc import EndpointPickerService

Mode = processing_mode_pb2.ProcessingMode

#: a vLLM /metrics answer, as the model server writes it (the series the router reads)
VLLM_METRICS = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="m1"}} {waiting}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m1"}} {running}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="m1"}} 0.25
vllm:cache_config_info{{block_size="16",num_gpu_blocks="1000"}} 1.0
"""


def headers_message(
    headers: Mapping[str, str] | None = None,
    *,
    end_of_stream: bool = False,
    mode: int | None = None,
    subset: Any = None,
    status: int | None = None,
    served: str | None = None,
    response: bool = False,
) -> pb.ProcessingRequest:
    """A request- or response-headers message as Envoy sends it (raw_value, lower-case keys)."""
    items = dict(headers or {})
    if status is not None:
        items[":status"] = str(status)
    http = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()) for k, v in items.items()
            ]
        ),
        end_of_stream=end_of_stream,
    )
    message = (
        pb.ProcessingRequest(response_headers=http)
        if response
        else pb.ProcessingRequest(request_headers=http)
    )
    if mode is not None:
        message.protocol_config.request_body_mode = mode
        message.protocol_config.response_body_mode = mode
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    if served is not None:
        lb = struct_pb2.Struct()
        lb.update({"x-gateway-destination-endpoint-served": served})
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(lb)
    return message


def body_message(
    data: bytes, *, end_of_stream: bool, response: bool = False
) -> pb.ProcessingRequest:
    body = pb.HttpBody(body=data, end_of_stream=end_of_stream)
    return (
        pb.ProcessingRequest(response_body=body)
        if response
        else pb.ProcessingRequest(request_body=body)
    )


class Gateway:
    """Plays the gateway: one ``Process`` stream per HTTP request."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.stub = pb_grpc.ExternalProcessorStub(channel)

    def open(self) -> Any:
        return self.stub.Process()

    async def exchange(
        self, messages: Sequence[pb.ProcessingRequest], answers: int
    ) -> list[pb.ProcessingResponse]:
        """Send ``messages``, read ``answers`` answers, close our side."""
        call = self.open()
        for message in messages:
            await call.write(message)
        out = [await call.read() for _ in range(answers)]
        await call.done_writing()
        return out


GatewayFactory = Callable[[EndpointPickerService], Awaitable[Gateway]]


@pytest.fixture
async def gateway_factory() -> AsyncIterator[GatewayFactory]:
    """``await make(service)``: the service on a loopback gRPC server, and a gateway for it."""
    servers: list[grpc.aio.Server] = []
    channels: list[grpc.aio.Channel] = []

    async def make(service: EndpointPickerService) -> Gateway:
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return Gateway(channel)

    yield make
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(0)


class MetricsServer:
    """A model server's /metrics on loopback (vLLM names); ``stop()`` makes it go away."""

    def __init__(self, waiting: int = 0, running: int = 0) -> None:
        self.waiting, self.running = waiting, running
        self.body: str | None = None  # replaces the vLLM text when set
        self.status = 200
        self.content_type = "text/plain"
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _metrics(self, _: web.Request) -> web.Response:
        text = (
            self.body
            if self.body is not None
            else VLLM_METRICS.format(waiting=self.waiting, running=self.running)
        )
        return web.Response(text=text, status=self.status, content_type=self.content_type)

    async def start(self, port: int = 0) -> MetricsServer:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.port = self.runner.addresses[0][1]
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def metrics_servers() -> AsyncIterator[Callable[..., Awaitable[MetricsServer]]]:
    started: list[MetricsServer] = []

    async def make(**kw: Any) -> MetricsServer:
        server = await MetricsServer(**kw).start()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop()
