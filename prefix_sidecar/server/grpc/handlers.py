"""Register the servicer with request decoding that cannot fail as INTERNAL.

The generated `add_RouterServicer_to_server` decodes with `FromString`, and a request with
invalid UTF-8 in a string field then dies inside grpc as INTERNAL "Exception deserializing
request". Decoding here returns a marker instead, and the handler answers it with
INVALID_ARGUMENT and the parser's reason: bad input gets the right status.
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
    """A request whose bytes did not parse; carries the reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _decoder(message_class: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except protobuf_message.DecodeError as exc:
            return Undecodable(str(exc) or "malformed protobuf")

    return decode


def _reject_message(request: Undecodable) -> str:
    return (
        f"the request could not be decoded ({request.reason}); string fields must be valid "
        "UTF-8 and the message must match prefix_sidecar.v1"
    )


def _reject_undecodable(method: Callable[..., Any]) -> Callable[..., Any]:
    """Answer an Undecodable request with INVALID_ARGUMENT before a coroutine method runs:
    a unary method, or a streaming one that sends with context.write (the check then costs
    one await at the start instead of a generator resume per message)."""

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _reject_message(request))
        return await method(request, context)

    return handle


def _reject_undecodable_stream(
    method: Callable[..., AsyncIterator[Any]],
) -> Callable[..., AsyncIterator[Any]]:
    """The same for a streaming method written as an async generator."""

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _reject_message(request))
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
        if method.server_streaming:
            wrap = (
                _reject_undecodable
                if inspect.iscoroutinefunction(implementation)
                else _reject_undecodable_stream
            )
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                wrap(implementation),
                request_deserializer=_decoder(request_class),
                response_serializer=response_class.SerializeToString,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _reject_undecodable(implementation),
                request_deserializer=_decoder(request_class),
                response_serializer=response_class.SerializeToString,
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
