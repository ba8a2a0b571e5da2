"""A small HTTP/1.1 server on asyncio.Protocol: the OpenAI front's (server.openai.front).

llhttp (httptools) parses straight from data_received; answers go straight to the transport,
with its backpressure. Per connection: one request at a time (a pipelined one waits in a
bounded buffer), keep-alive, Content-Length or chunked bodies, the handler run once the body
is whole and cancelled when the caller leaves. Bounded against callers: head size and header
count, body size (413 early from Content-Length), a chunked body's wire bytes
(MAX_WIRE_OVERHEAD), head, body, idle and write-stall times, and open connections (503 past
`max_connections`). A self-answered error closes the connection after dropping what still
comes for up to LINGER_S, so the client reads the answer, not a reset. Parts:
http1_connection, http1_reading (where llhttp reads), http1_answer, http1_request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field

from prefix_sidecar.server.common.connections import AcceptLog
from prefix_sidecar.server.openai.http1_answer import Response, StreamedResponse, answer_head
from prefix_sidecar.server.openai.http1_connection import Connection
from prefix_sidecar.server.openai.http1_reading import MAX_HEAD_BYTES, MAX_WIRE_OVERHEAD
from prefix_sidecar.server.openai.http1_request import HTTPError, Request

__all__ = [
    "MAX_HEAD_BYTES",
    "MAX_WIRE_OVERHEAD",
    "HTTP1Server",
    "HTTPError",
    "Request",
    "Response",
    "StreamedResponse",
]

logger = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response | StreamedResponse]]
ErrorBody = Callable[[int, str], bytes]


@dataclass(eq=False)
class HTTP1Server:
    """The protocol factory for loop.create_server / create_unix_server, and its connections'
    shared state. `error_body(status, message)`: the body of errors the server answers
    itself. Past `max_connections`, a new connection gets 503 and is closed at once."""

    handler: Handler
    _: KW_ONLY
    max_body_bytes: int
    error_body: ErrorBody
    max_connections: int = 4096
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop, init=False)
    connections: set[Connection] = field(default_factory=set, init=False)
    # Set when stopping: every answer then closes its connection.
    draining: bool = field(default=False, init=False)
    refused_connections: int = field(default=0, init=False)
    _log: AcceptLog = field(default_factory=lambda: AcceptLog(logger), init=False)

    def __call__(self) -> Connection:
        return Connection(self)

    def error(self, status: int, message: str) -> Response:
        return Response(status, self.error_body(status, message), content_type="application/json")

    def refused(self, transport: asyncio.Transport) -> None:
        """A connection over the cap: a 503 and the close, now (its fd is back at once)."""
        self.refused_connections += 1
        answer = self.error(503, f"the sidecar is at its {self.max_connections} connections")
        headers = [*answer.headers, ("Retry-After", "1")]
        head = answer_head(503, headers, False, len(answer.body), True, True)
        transport.write(head + answer.body)
        if transport.get_write_buffer_size():
            transport.abort()  # a caller that cannot take 200 bytes now gets none
        else:
            transport.close()
        self._log.over_cap(self.max_connections)

    def close_all(self) -> None:
        """Close every connection; a handler still running is cancelled."""
        for connection in list(self.connections):
            connection.close_now()
