"""The gRPC Health Checking Protocol (``grpc.health.v1.Health``) on the picker's gRPC server.

The endpoint-picker protocol asks for it, with three service names:

* ``liveness``: SERVING while the process answers;
* ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor``: SERVING
  once the router can take requests (discovery has said what the endpoints
  are), NOT_SERVING before that and while shutting down;
* ``""`` (the whole server, what kubelet's gRPC probe asks by default): as readiness.

An unknown name gets NOT_FOUND from ``Check`` and SERVICE_UNKNOWN from
``Watch``, as the protocol says; ``List`` answers every name above with its
status. The four messages are declared here from
their ``.proto`` definition (grpcio-health-checking is not a dependency),
in a descriptor pool of their own so they never clash with another copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE = "grpc.health.v1.Health"
LIVENESS = "liveness"
READINESS = "readiness"
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"

UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3
#: how often ``Watch`` looks for a change, seconds
WATCH_POLL_S = 1.0


def _messages() -> tuple[Any, ...]:
    proto = descriptor_pb2.FileDescriptorProto(
        name="cachefleet/grpc/health/v1/health.proto", package="grpc.health.v1", syntax="proto3"
    )
    request = proto.message_type.add(name="HealthCheckRequest")
    request.field.add(
        name="service",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    response = proto.message_type.add(name="HealthCheckResponse")
    enum = response.enum_type.add(name="ServingStatus")
    for name, number in (
        ("UNKNOWN", UNKNOWN),
        ("SERVING", SERVING),
        ("NOT_SERVING", NOT_SERVING),
        ("SERVICE_UNKNOWN", SERVICE_UNKNOWN),
    ):
        enum.value.add(name=name, number=number)
    response.field.add(
        name="status",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_ENUM,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    proto.message_type.add(name="HealthListRequest")
    listing = proto.message_type.add(name="HealthListResponse")
    entry = listing.nested_type.add(name="StatusesEntry")
    entry.options.map_entry = True
    entry.field.add(
        name="key",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    entry.field.add(
        name="value",
        number=2,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
        type_name=".grpc.health.v1.HealthCheckResponse",
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    listing.field.add(
        name="statuses",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
        type_name=".grpc.health.v1.HealthListResponse.StatusesEntry",
        label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return tuple(
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.health.v1.{name}"))
        for name in (
            "HealthCheckRequest",
            "HealthCheckResponse",
            "HealthListRequest",
            "HealthListResponse",
        )
    )


HealthCheckRequest, HealthCheckResponse, HealthListRequest, HealthListResponse = _messages()
#: the service names this server knows (``List`` answers each)
SERVICES = ("", LIVENESS, READINESS, EXT_PROC)


class HealthService:
    """Answers from ``ready()``; :meth:`shutting_down` turns every service NOT_SERVING."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready
        self._stopping = False

    def shutting_down(self) -> None:
        self._stopping = True

    def status(self, service: str) -> int:
        if service == LIVENESS:
            return NOT_SERVING if self._stopping else SERVING
        if service in {"", READINESS, EXT_PROC}:
            return SERVING if (self._ready() and not self._stopping) else NOT_SERVING
        return SERVICE_UNKNOWN

    async def check(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        status = self.status(request.service)
        if status == SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=status)

    async def list(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        answer = HealthListResponse()
        for name in SERVICES:
            answer.statuses[name].status = self.status(name)
        return answer

    async def watch(
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        last = -1
        while True:
            status = self.status(request.service)
            if status != last:
                yield HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_POLL_S)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Check": grpc.unary_unary_rpc_method_handler(
                    self.check,
                    request_deserializer=HealthCheckRequest.FromString,
                    response_serializer=HealthCheckResponse.SerializeToString,
                ),
                "List": grpc.unary_unary_rpc_method_handler(
                    self.list,
                    request_deserializer=HealthListRequest.FromString,
                    response_serializer=HealthListResponse.SerializeToString,
                ),
                "Watch": grpc.unary_stream_rpc_method_handler(
                    self.watch,
                    request_deserializer=HealthCheckRequest.FromString,
                    response_serializer=HealthCheckResponse.SerializeToString,
                ),
            },
        )
