"""Register the servicer with request decoding that cannot fail as INTERNAL.

With the generated `add_RouterServicer_to_server`, invalid UTF-8 in a string field dies inside
grpc as INTERNAL "Exception deserializing request". Here decoding returns a marker, which the
handler answers with INVALID_ARGUMENT and the parser's reason.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import message as protobuf_message
from google.protobuf import symbol_database

from prefix_sidecar.v1 import router_pb2

SERVICE = "sidecar.v1.Router"


class Undecodable:
    """A request whose bytes did not parse; carries the INVALID_ARGUMENT message it gets."""

    def __init__(self, reason: str) -> None:
        self.message = (
            f"the request could not be decoded ({reason}); string fields must be valid "
            "UTF-8 and the message must match prefix_sidecar.v1"
        )


def _decoder(message_class: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except protobuf_message.DecodeError as exc:
            return Undecodable(str(exc) or "malformed protobuf")

    return decode


def _reject_undecodable(method: Callable[..., Any]) -> Callable[..., Any]:
    """Answer an Undecodable request with INVALID_ARGUMENT before a coroutine method runs
    (unary, or streaming with context.write: one await, not a generator resume per message)."""

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await method(request, context)

    return handle


def _reject_undecodable_stream(
    method: Callable[..., AsyncIterator[Any]],
) -> Callable[..., AsyncIterator[Any]]:
    """The same for a streaming method written as an async generator."""

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for item in method(request, context):
            yield item

    return handle


def add_router_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    service = router_pb2.DESCRIPTOR.services_by_name["Router"]
    database = symbol_database.Default()
    handlers = {}
    for method in service.methods:
        request_class = database.GetSymbol(method.input_type.full_name)
        response_class = database.GetSymbol(method.output_type.full_name)
        implementation = getattr(servicer, method.name)
        wrap = (
            _reject_undecodable_stream
            if inspect.isasyncgenfunction(implementation)
            else _reject_undecodable
        )
        kind = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = kind(
            wrap(implementation),
            request_deserializer=_decoder(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
