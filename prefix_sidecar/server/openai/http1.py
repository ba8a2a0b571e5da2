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

Where llhttp reads: the head from its first byte to its blank line (found here, so the
request line is checked before llhttp reads it and a head is counted exactly), a
Content-Length body to its last byte, a chunked body in steps, each ending at the latest
after a CRLFCRLF (where alone a chunked message can end). So llhttp never reads past the
message in hand, and each message starts at the start of a feed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httptools

from prefix_sidecar.server.common.connections import AcceptLog
from prefix_sidecar.server.openai.http1_answer import Response, StreamedResponse, answer_head
from prefix_sidecar.server.openai.http1_request import (
    HTTPError,
    Request,
    RequestReader,
    check_request_line,
    too_large,
)

__all__ = ["HTTP1Server", "HTTPError", "Request", "Response", "StreamedResponse"]

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024  # the request line and headers
HEAD_TIMEOUT_S = 10.0  # from a request's first byte to its head's end
BODY_TIMEOUT_S = 60.0  # from the head's end to the body's
IDLE_TIMEOUT_S = 75.0  # a kept-alive connection with no request
WRITE_STALL_S = 60.0  # a caller that reads none of its answer for this long is dropped
LINGER_S = 2.0  # reading and dropping a refused body before the close
MAX_LINGER_BYTES = 64 * 1024 * 1024
# A chunked body's wire bytes beyond its data: a quarter of the body limit (chunks of 28
# bytes and more fit: "1c\r\n" + data + "\r\n"), and at least 64 KiB. In 2-byte chunks, 7
# wire bytes carry 2 of data: such a body meets this bound long before the data limit.
MAX_WIRE_OVERHEAD = 4
MIN_WIRE_OVERHEAD = 64 * 1024
# llhttp calls back once per chunk: 64 KiB of 2-byte chunks is ~9,400 calls, ~4 ms. A
# chunked body is fed in steps of this many bytes, the loop serving others between them.
CHUNKED_STEP = 64 * 1024
MAX_FEEDS_PER_STEP = 256  # a body dense with CRLFCRLF is fed up to each of them

Handler = Callable[[Request], Awaitable[Response | StreamedResponse]]
ErrorBody = Callable[[int, str], bytes]

_HEAD, _BODY, _SERVING = 0, 1, 2


class _Connection(asyncio.Protocol):
    """One caller's connection: read a request, run the handler, write its answer, again."""

    def __init__(self, server: HTTP1Server) -> None:
        self._server = server
        self._loop = server.loop
        self._transport: asyncio.Transport | None = None
        self._reader = RequestReader(self, server.max_body_bytes)
        self._buffer = bytearray()  # what the caller sent and llhttp has not read
        self._scanned = 0  # how far the head's end was looked for in _buffer
        self._phase = _HEAD
        self._request: Request | None = None
        self._task: asyncio.Task[None] | None = None
        self._left = 0  # Content-Length bytes still to come; for chunked, wire bytes allowed
        self._raw_body = False  # an Upgrade's body, read by its Content-Length (llhttp won't)
        self._stepping = False  # a chunked body's next step is scheduled
        self._tail = b""  # the last bytes of a chunked body fed: a CRLFCRLF may span feeds
        self._timer: asyncio.TimerHandle | None = None
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._lingering = False
        self._lingered = 0
        self._read_paused = False
        self._answer_started = False
        self._closed_by_us = False
        self.must_close = False

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        server = self._server
        if len(server.connections) >= server.max_connections:
            server.refused(transport)
            self._transport = None
            return
        server.connections.add(self)
        self._arm(IDLE_TIMEOUT_S, self._idle_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._server.connections.discard(self)
        self._disarm()
        self._buffer = bytearray()
        if self._task is not None and not self._task.done() and not self._closed_by_us:
            self._task.cancel()  # the caller left: its pod request ends too
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the caller closed the connection"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._transport is None:
            return
        if self._lingering:
            self._lingered += len(data)
            if self._lingered > MAX_LINGER_BYTES:
                self.abort()
            return
        if self._phase == _BODY and not self._buffer and not self._reader.chunked:
            self._body_direct(data)  # a Content-Length body: no copy into the buffer
            return
        self._buffer += data
        if self._phase == _SERVING:
            # The next request, pipelined: read once this one is answered.
            if len(self._buffer) > MAX_HEAD_BYTES:
                self._pause_reading()
            return
        self._advance()

    def eof_received(self) -> bool | None:
        return None  # a caller that half-closes is gone: close (and cancel its handler)

    # --- reading ------------------------------------------------------------------------

    def _advance(self) -> None:
        """Read what the buffer holds, as far as the current request goes."""
        try:
            if self._phase == _HEAD:
                self._read_head()
            if self._phase == _BODY:
                self._read_body()
        except HTTPError as exc:
            self._refuse(exc)

    def _read_head(self) -> None:
        buffer = self._buffer
        if not self._scanned and buffer[:2] == b"\r\n":
            del buffer[: len(buffer) - len(buffer.lstrip(b"\r\n"))]  # blank lines before it
        end = buffer.find(b"\r\n\r\n", max(0, self._scanned - 3), MAX_HEAD_BYTES + 4)
        if end < 0:
            if len(buffer) > MAX_HEAD_BYTES:
                raise HTTPError(431, f"the request head is over {MAX_HEAD_BYTES} bytes")
            if buffer and not self._scanned:
                self._arm(HEAD_TIMEOUT_S, self._head_expired)
            self._scanned = len(buffer)
            return
        head = bytes(buffer[: end + 4])
        del buffer[: end + 4]
        self._scanned = 0
        check_request_line(head)
        reader = self._reader
        reader.reset()
        try:
            reader.feed(head)
        except httptools.HttpParserUpgrade:
            self._upgraded()
        request = reader.request
        assert request is not None  # llhttp read the whole head, or raised
        self._disarm()
        self._request = request
        if not reader.keep_alive:
            self.must_close = True
        if reader.complete and not self._raw_body:
            self._start()
            return
        self._phase = _BODY
        self._tail = b""
        if reader.chunked:
            limit = self._server.max_body_bytes
            self._left = limit + max(limit // MAX_WIRE_OVERHEAD, MIN_WIRE_OVERHEAD)
        else:
            self._left = reader.length
        if reader.expect_continue and not buffer:
            assert self._transport is not None
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._arm(BODY_TIMEOUT_S, self._body_expired)

    def _upgraded(self) -> None:
        """llhttp hands a request asking for an Upgrade (h2c, websocket) on to the other
        protocol after its head. None is served: the request is, as HTTP/1.1, its body read
        by its Content-Length, and the connection closes after its answer."""
        reader = self._reader
        if reader.chunked:
            raise HTTPError(400, "an Upgrade request with a chunked body")
        self.must_close = True
        self._raw_body = reader.length > 0

    def _body_direct(self, data: bytes) -> None:
        left = self._left
        if len(data) > left:
            self._buffer += memoryview(data)[left:]
            data = data[:left]
        try:
            self._feed_body(data)
        except HTTPError as exc:
            self._refuse(exc)

    def _read_body(self) -> None:
        buffer = self._buffer
        reader = self._reader
        if not reader.chunked:
            if buffer:
                take = min(len(buffer), self._left)
                data = bytes(buffer[:take])
                del buffer[:take]
                self._feed_body(data)
            return
        # Chunked: a step at a time, the loop serving others between the steps.
        if self._stepping or not buffer:
            return
        budget, feeds = CHUNKED_STEP, 0
        while buffer and budget > 0 and self._left > 0 and not reader.complete:
            cut = self._chunk_cut(min(len(buffer), budget, self._left))
            data = bytes(buffer[:cut])
            del buffer[:cut]
            self._left -= cut
            budget -= cut
            self._tail = (self._tail + data)[-3:]
            reader.feed(data)
            feeds += 1
            if feeds >= MAX_FEEDS_PER_STEP:
                break
        if reader.complete:
            if reader.overrun:  # not expected (see _chunk_cut): read nothing after it
                self.must_close = True
                buffer.clear()
            self._body_complete()
        elif not self._left:
            limit = self._server.max_body_bytes
            raise HTTPError(
                413, f"the chunked body is over its wire limit (config max_message_bytes: {limit})"
            )
        elif buffer:
            self._stepping = True
            self._pause_reading()
            self._loop.call_soon(self._step)

    def _chunk_cut(self, take: int) -> int:
        """How much of the buffer's first `take` bytes to feed next: up to the end of the
        first CRLFCRLF in them (or across the last feed's end). A chunked message can end
        only there, so llhttp never reads past it: what follows is the next request's head,
        read from its first byte."""
        buffer = self._buffer
        tail = self._tail
        if tail:
            across = (tail + bytes(buffer[:3])).find(b"\r\n\r\n")
            if across >= 0:
                return min(take, across + 4 - len(tail))
        end = buffer.find(b"\r\n\r\n", 0, take)
        return end + 4 if end >= 0 else take

    def _step(self) -> None:
        self._stepping = False
        if self._transport is None or self._lingering or self._phase != _BODY:
            return
        self._advance()
        if self._phase == _BODY and not self._stepping and self._read_paused:
            self._read_paused = False
            self._transport.resume_reading()

    def _feed_body(self, data: bytes) -> None:
        """A Content-Length body's next bytes (at most what is left of it)."""
        self._left -= len(data)
        reader = self._reader
        if self._raw_body:
            reader.on_body(data)  # counted and kept as llhttp's would be
            if not self._left:
                self._body_complete()
            return
        reader.feed(data)
        if reader.complete:
            self._body_complete()

    def _body_complete(self) -> None:
        self._disarm()
        self._start()

    def _start(self) -> None:
        """The request is whole: run its handler. (Not before: a handler that waited for
        the body would cost a task switch more; `Expect: 100-continue` is answered as soon
        as the head is read and its Content-Length is within the limit.)"""
        request = self._request
        assert request is not None
        request.body = self._reader.body()
        self._phase = _SERVING
        self._raw_body = False
        self._reader.reset()
        if len(self._buffer) > MAX_HEAD_BYTES:
            self._pause_reading()
        self._task = self._loop.create_task(self._serve(request))

    def _pause_reading(self) -> None:
        if not self._read_paused and self._transport is not None:
            self._read_paused = True
            self._transport.pause_reading()

    # --- answering ----------------------------------------------------------------------

    async def _serve(self, request: Request) -> None:
        server = self._server
        try:
            answer = await server.handler(request)
        except (ConnectionError, asyncio.CancelledError):
            self.abort()
            return
        except Exception as exc:
            if self._answer_started:  # no error answer fits after part of another
                logger.info("the HTTP front's answer broke off: %r", exc)
                self.abort()
                return
            if isinstance(exc, HTTPError):
                answer = server.error(exc.status, exc.message)
            else:
                logger.exception(
                    "the HTTP front failed on %s %s", request.method, request.path[:100]
                )
                answer = server.error(500, "the sidecar failed to handle the request")
        if isinstance(answer, Response):
            self._write_whole(request, answer)
        elif not answer.ended:
            self.abort()  # a stream that did not end: its client must not take it as whole
            return
        self._finish()

    def _write_whole(self, request: Request, answer: Response) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        body = answer.body
        head = self.head(answer.status, answer.headers, None, len(body))
        transport.write(head if request.method == "HEAD" or not body else head + body)

    def _finish(self) -> None:
        """The answer is out: the next request (already here, maybe), or the close."""
        self._request = None
        self._task = None
        self._answer_started = False
        self._phase = _HEAD
        transport = self._transport
        if transport is None:
            return
        if self.must_close or self._server.draining:
            self._close_after_answer()
            return
        self._arm(IDLE_TIMEOUT_S, self._idle_expired)
        if self._read_paused:
            self._read_paused = False
            transport.resume_reading()
        if self._buffer:
            self._advance()

    def head(
        self,
        status: int,
        headers: list[tuple[str, str]],
        framing: str | None,
        length: int | None,
    ) -> bytes:
        """The status line and headers; `framing` "Transfer-Encoding" for chunked, else
        `length` for a Content-Length (None: the close ends the body)."""
        self._answer_started = True
        if framing is None and length is None:
            self.must_close = True
        request = self._request
        close = self.must_close or self._server.draining
        return answer_head(
            status, headers, framing, length, close, request is None or request.http11
        )

    async def send(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the caller closed the connection")
        transport.write(data)
        if self._write_paused:
            self._drain_waiter = waiter = self._loop.create_future()
            try:
                async with asyncio.timeout(WRITE_STALL_S):
                    await waiter
            except TimeoutError:
                self.abort()  # a caller that reads nothing must not hold its pod forever
                raise ConnectionResetError("the caller stopped reading") from None

    def _refuse(self, error: HTTPError) -> None:
        """Answer an error the server found itself, then close, dropping what still comes."""
        self._disarm()
        transport = self._transport
        if transport is None:
            return
        self.must_close = True
        self._lingering = True
        self._request = None
        self._buffer = bytearray()
        self._reader.reset()
        answer = self._server.error(error.status, error.message)
        transport.write(
            self.head(answer.status, answer.headers, None, len(answer.body)) + answer.body
        )
        self._close_after_answer()

    def _close_after_answer(self) -> None:
        """Close once the answer is written. A caller that may still be sending (a refused
        head or body) is half-closed and what it sends dropped for up to LINGER_S, so its
        client reads the answer rather than a reset."""
        transport = self._transport
        if transport is None:
            return
        if not self._lingering:
            self._closed_by_us = True
            transport.close()
            return
        if self._read_paused:
            self._read_paused = False
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
        self._arm(LINGER_S, self.abort)

    def abort(self) -> None:
        transport = self._transport
        if transport is not None:
            self._closed_by_us = True
            transport.close()

    def close_now(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
        self.abort()

    # --- timers -------------------------------------------------------------------------

    def _arm(self, seconds: float, callback: Callable[[], None]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle_expired(self) -> None:
        self._timer = None
        if self._request is None and not self._buffer:
            self.abort()

    def _head_expired(self) -> None:
        self._timer = None
        self._refuse(HTTPError(408, f"the request head took over {HEAD_TIMEOUT_S:g} s"))

    def _body_expired(self) -> None:
        self._timer = None
        if self._phase == _BODY:
            self._refuse(HTTPError(408, f"the request body took over {BODY_TIMEOUT_S:g} s"))


class HTTP1Server:
    """The protocol factory for loop.create_server / create_unix_server, and the state its
    connections share. `error_body(status, message)` writes the body of the errors the
    server answers itself (the front's: OpenAI's shape). Over `max_connections` open
    connections, a new one is answered 503 and closed at once (`refused_connections`)."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        error_body: ErrorBody,
        max_connections: int = 4096,
    ) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.error_body = error_body
        self.max_connections = max_connections
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        self.draining = False  # set when stopping: every answer then closes its connection
        self.refused_connections = 0
        self._log = AcceptLog(logger)

    def __call__(self) -> _Connection:
        return _Connection(self)

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
