"""A small HTTP/1.1 server on asyncio.Protocol: the OpenAI front's (server.openai.front).

The front needs little of HTTP: a request's head and whole body in, a whole answer or a
stream out. This server reads the request straight from data_received, llhttp parsing it
(httptools; prefix_sidecar.server.openai.http1_request adds the rules llhttp leaves out),
and writes the answer straight to the transport; behind aiohttp's low-level server the same
handler took ~0.19 ms more per 240 KB request (`bench hop --frame-ab` reruns that A/B).

What it does per connection: one request at a time (a pipelined next request waits in a
bounded buffer until the answer is out), keep-alive unless the caller or HTTP/1.0 says
otherwise, Content-Length and chunked bodies, the handler run once the body is whole,
`Expect: 100-continue` answered once the head is read and its Content-Length is within the
limit, whole answers with Content-Length and streamed ones chunked (HTTP/1.0: delimited by
the close), with the transport's backpressure (pause_writing/resume_writing). Bounded: the
head's size and header count, the body's size (413 before reading it when Content-Length
says so), a chunked body's bytes on the wire, chunk sizes and extensions included
(MAX_WIRE_OVERHEAD), the time to send a head and a body, an idle keep-alive connection's
time, how long a caller may read nothing of its answer, and the connections (over
`max_connections` one is answered 503 and closed at once). One buffer holds what a
connection sent and llhttp has not read, and one the body; a chunked body is read at most
CHUNKED_STEP bytes per step of the loop. A caller that leaves cancels its request's
handler. An error the server answers itself closes the connection, after reading and
dropping (for at most LINGER_S) what the caller still sends, so its client reads the answer
instead of a reset. While draining, every answer closes its connection.

The connection is http1_connection.Connection (its reading half: http1_reading, where
llhttp reads), its answers http1_answer, the request and llhttp's callbacks http1_request.
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
from prefix_sidecar.server.openai.http1_request import HTTPError, Request, too_large

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
    """The protocol factory for loop.create_server / create_unix_server, and the state its
    connections share. `error_body(status, message)` writes the body of the errors the
    server answers itself (the front's: OpenAI's shape). Over `max_connections` open
    connections, a new one is answered 503 and closed at once (`refused_connections`)."""

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

    def too_large(self, size: int) -> HTTPError:
        return too_large(size, self.max_body_bytes)

    def refused(self, transport: asyncio.Transport) -> None:
        """A connection over the cap: a 503 and the close, now (its fd is back at once)."""
        self.refused_connections += 1
        answer = self.error(503, f"the sidecar is at its {self.max_connections} connections")
        headers = [*answer.headers, ("Retry-After", "1")]
        transport.write(answer_head(503, headers, None, len(answer.body), True, True) + answer.body)
        if transport.get_write_buffer_size():
            transport.abort()  # a caller that cannot take 200 bytes now gets none
        else:
            transport.close()
        self._log.over_cap(self.max_connections)

    def close_all(self) -> None:
        """Close every connection; a handler still running is cancelled."""
        for connection in list(self.connections):
            connection.close_now()
