"""A stand-in gateway for the local fleet: what Envoy does with an endpoint picker.

No Envoy binary exists here, so the demo and the e2e tests put this small
HTTP proxy in front of the model servers. For each request it does what a
Gateway API Inference Extension gateway does with its ``ext_proc`` filter:

1. opens an ``ext_proc`` stream to the picker (``--picker HOST:PORT``) and
   sends the request headers (``:method``, ``:path``, ``:authority``, then
   the client's headers) and the whole body, ending the stream's request
   side, as Envoy does with a buffered or full-duplex body mode;
2. reads the picker's answers until the one for the body (or an
   ``immediate_response``, which it relays as is), collecting header
   mutations and the ``envoy.lb`` dynamic metadata;
3. forwards the request to the endpoint named by
   ``x-gateway-destination-endpoint`` (with the body the picker may have
   replaced), streaming the answer back as it comes;
4. sends the answer's headers to the picker (so it learns the request got
   its first bytes) and closes the stream.

``--round-robin`` skips the picker and cycles over ``--endpoints``: the
baseline the demo compares against. With ``--fail-open``, a picker that
cannot be reached (or names no endpoint) falls back to round-robin, as the
``FailOpen`` mode of an ``InferencePool``'s picker reference does; without
it the client gets 503.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp.web
import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

log = logging.getLogger("cachefleet.gateway")

#: The header through which the picker names the endpoint (GIE endpoint-picker protocol).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
#: Hop-by-hop headers a proxy never forwards (RFC 9110 7.6.1), plus what httpx sets itself.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
#: How long the picker may take to answer one request before the gateway gives up on it.
PICKER_TIMEOUT_S = 5.0
UPSTREAM_TIMEOUT_S = 300.0


class PickerUnavailable(Exception):
    """The picker could not be asked, or named no endpoint."""


@dataclass(slots=True)
class Picked:
    """What the picker said about one request."""

    endpoint: str | None = None
    immediate: ep.ImmediateResponse | None = None
    body: bytes | None = None
    set_headers: dict[str, str] = field(default_factory=dict)
    metadata_endpoint: str | None = None


def _header(key: str, value: str) -> base_pb2.HeaderValue:
    return base_pb2.HeaderValue(key=key, raw_value=value.encode())


def _value(h: base_pb2.HeaderValue) -> str:
    return str(h.raw_value.decode("latin-1") if h.raw_value else h.value)


def _collect(common: ep.CommonResponse, picked: Picked) -> None:
    for option in common.header_mutation.set_headers:
        name = option.header.key.lower()
        picked.set_headers[name] = _value(option.header)
        if name == DESTINATION_HEADER:
            picked.endpoint = _value(option.header)
    mutation = common.body_mutation
    if mutation.HasField("body"):
        picked.body = mutation.body
    elif mutation.HasField("streamed_response"):
        picked.body = (picked.body or b"") + mutation.streamed_response.body


class Gateway:
    """The proxy: one aiohttp handler, one ext_proc stream per request."""

    def __init__(
        self,
        *,
        picker: str | None,
        endpoints: Sequence[str],
        fail_open: bool = False,
    ) -> None:
        if picker is None and not endpoints:
            raise ValueError("a gateway needs --picker or --endpoints")
        self.picker = picker
        self.endpoints = list(endpoints)
        self.fail_open = fail_open
        self._rr = itertools.cycle(self.endpoints) if self.endpoints else None
        self._channel: grpc.aio.Channel | None = None
        self._stub: ep_grpc.ExternalProcessorStub | None = None
        self._client: httpx.AsyncClient | None = None
        self.routed: dict[str, int] = {}
        self.picker_failures = 0

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
        self._client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT_S, limits=limits)
        if self.picker:
            self._channel = grpc.aio.insecure_channel(self.picker)
            self._stub = ep_grpc.ExternalProcessorStub(self._channel)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        if self._channel is not None:
            await self._channel.close()

    def _round_robin(self) -> str:
        if self._rr is None:
            raise PickerUnavailable("no --endpoints to fall back on")
        return next(self._rr)

    async def _ask(
        self,
        call: grpc.aio.StreamStreamCall,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
    ) -> Picked:
        pseudo = [_header(":method", method), _header(":path", path), _header(":scheme", "http")]
        pseudo.append(_header(":authority", headers.get("host", "gateway")))
        plain = [_header(k.lower(), v) for k, v in headers.items() if k.lower() != "host"]
        await call.write(
            ep.ProcessingRequest(
                request_headers=ep.HttpHeaders(
                    headers=base_pb2.HeaderMap(headers=pseudo + plain), end_of_stream=not body
                )
            )
        )
        if body:
            await call.write(
                ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
            )
        picked = Picked()
        while True:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                break
            assert isinstance(reply, ep.ProcessingResponse)
            lb = reply.dynamic_metadata.fields.get("envoy.lb")
            if lb is not None and DESTINATION_HEADER in lb.struct_value.fields:
                picked.metadata_endpoint = lb.struct_value.fields[DESTINATION_HEADER].string_value
            kind = reply.WhichOneof("response")
            if kind == "immediate_response":
                picked.immediate = reply.immediate_response
                return picked
            if kind == "request_headers":
                _collect(reply.request_headers.response, picked)
                if not body:
                    return picked
            elif kind == "request_body":
                _collect(reply.request_body.response, picked)
                return picked
        return picked

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        assert self._client is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items()}
        call: grpc.aio.StreamStreamCall | None = None
        endpoint: str | None = None
        picked = Picked()
        if self._stub is not None:
            try:
                call = self._stub.Process(timeout=UPSTREAM_TIMEOUT_S)
                picked = await asyncio.wait_for(
                    self._ask(call, request.method, request.path_qs, headers, body),
                    PICKER_TIMEOUT_S,
                )
                endpoint = picked.endpoint
                if picked.immediate is not None:
                    call.cancel()
                    imm = picked.immediate
                    return aiohttp.web.Response(
                        status=imm.status.code or 500,
                        body=imm.body,
                        headers={o.header.key: _value(o.header) for o in imm.headers.set_headers},
                    )
            except (grpc.aio.AioRpcError, TimeoutError) as exc:
                self.picker_failures += 1
                log.warning("picker failed: %s", exc)
                if call is not None:
                    call.cancel()
                call = None
            if endpoint is None:
                if not self.fail_open:
                    return aiohttp.web.json_response(
                        {"error": {"message": "no endpoint picked", "type": "unavailable"}},
                        status=503,
                    )
                endpoint = self._round_robin()
        else:
            endpoint = self._round_robin()
        self.routed[endpoint] = self.routed.get(endpoint, 0) + 1
        forward = {
            k: v
            for k, v in headers.items()
            if k.lower() not in _HOP and k.lower() != DESTINATION_HEADER
        }
        forward.update({k: v for k, v in picked.set_headers.items() if k != DESTINATION_HEADER})
        content = picked.body if picked.body is not None else body
        upstream = self._client.build_request(
            request.method, f"http://{endpoint}{request.path_qs}", headers=forward, content=content
        )
        try:
            answer = await self._client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            if call is not None:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self._tell(call, 502)
            return aiohttp.web.json_response(
                {"error": {"message": f"endpoint {endpoint}: {exc}", "type": "bad_gateway"}},
                status=502,
            )
        try:
            if call is not None:
                with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                    await asyncio.wait_for(self._tell(call, answer.status_code), PICKER_TIMEOUT_S)
            response = aiohttp.web.StreamResponse(status=answer.status_code)
            for k, v in answer.headers.items():
                if k.lower() not in _HOP:
                    response.headers[k] = v
            await response.prepare(request)
            async for chunk in answer.aiter_raw():
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            await answer.aclose()

    async def _tell(self, call: grpc.aio.StreamStreamCall, status: int) -> None:
        """The answer's head, as Envoy sends it to the processor; then the stream ends."""
        await call.write(
            ep.ProcessingRequest(
                response_headers=ep.HttpHeaders(
                    headers=base_pb2.HeaderMap(headers=[_header(":status", str(status))])
                )
            )
        )
        await call.read()
        await call.done_writing()


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m cachefleet_e2e.gateway", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--listen", default="127.0.0.1:8088", help="HOST:PORT to serve on")
    parser.add_argument("--picker", help="the endpoint picker's ext_proc address, HOST:PORT")
    parser.add_argument(
        "--endpoints", default="", help="HOST:PORT,... (round-robin, or the fail-open fallback)"
    )
    parser.add_argument("--round-robin", action="store_true", help="ignore --picker")
    parser.add_argument(
        "--fail-open", action="store_true", help="round-robin when the picker fails"
    )
    args = parser.parse_args(list(argv))
    if args.round_robin:
        args.picker = None
    if not args.picker and not args.endpoints:
        parser.error("give --picker HOST:PORT, or --round-robin with --endpoints")
    return args


async def serve(args: argparse.Namespace) -> None:
    host, _, port = args.listen.rpartition(":")
    endpoints = [e for e in args.endpoints.split(",") if e]
    gateway = Gateway(picker=args.picker, endpoints=endpoints, fail_open=args.fail_open)
    await gateway.start()
    app = aiohttp.web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", gateway.handle)
    runner = aiohttp.web.AppRunner(app, access_log=None)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, host, int(port)).start()
    print(f"gateway listening on {args.listen}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await gateway.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
