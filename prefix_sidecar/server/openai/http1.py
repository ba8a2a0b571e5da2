"""A small HTTP/1.1 server on asyncio.Protocol: the OpenAI front's (server.openai.front).

The front needs little of HTTP: a request's head and whole body in, a whole answer or a
stream out. This server reads the request straight from data_received and writes the
answer straight to the transport; behind aiohttp's low-level server the same handler took
~0.19 ms more per 240 KB request (docs/benchmarks.md, the HTTP front on its own server).

What it does per connection: one request at a time (a pipelined next request waits in a
bounded buffer until the answer is out), keep-alive unless the caller or HTTP/1.0 says
otherwise, Content-Length and chunked bodies (prefix_sidecar.server.openai.http1_parse reads them
strictly), the handler run once the body is whole, `Expect: 100-continue` answered once the
head is read and its Content-Length is within the limit, whole answers with Content-Length
and streamed ones chunked (HTTP/1.0: delimited by the close), with the transport's
backpressure (pause_writing/resume_writing). Bounded: the head's size and header count, the
body's size (413 before reading it when Content-Length says so), the time to send a head
and a body, an idle keep-alive connection's time, and how long a caller may read nothing of
its answer. A caller that leaves cancels its request's handler. An error the server answers
itself closes the connection, after reading and dropping (for at most LINGER_S) what the
caller still sends, so its client reads the answer instead of a reset. While draining,
every answer closes its connection.
"""

from __future__ import annotations

import asyncio
import email.utils
import http
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable

from prefix_sidecar.server.openai.http1_parse import ChunkedBody, Head, HTTPError, parse_head

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024  # the request line and headers
HEAD_TIMEOUT_S = 10.0  # from a request's first byte to its head's end
BODY_TIMEOUT_S = 60.0  # from the head's end to the body's
IDLE_TIMEOUT_S = 75.0  # a kept-alive connection with no request
WRITE_STALL_S = 60.0  # a caller that reads none of its answer for this long is dropped
LINGER_S = 2.0  # reading and dropping a refused body before the close
MAX_LINGER_BYTES = 64 * 1024 * 1024

# A header value we write must not end the header (a pod's Content-Type is passed on).
_UNSAFE_VALUE = re.compile(r"[\r\n\x00]")
_REASONS = {status.value: status.phrase for status in http.HTTPStatus}

Handler = Callable[["Request"], Awaitable["Response | StreamedResponse"]]
ErrorBody = Callable[[int, str], bytes]


class Response:
    """A whole answer: written at once, with its Content-Length."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        status: int,
        body: bytes = b"",
        headers: Iterable[tuple[str, str]] = (),
        content_type: str | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers = list(headers)
        if content_type is not None:
            self.headers.append(("Content-Type", content_type))


class StreamedResponse:
    """An answer written as it comes: its head leaves with the first `write` (one wakeup of
    the caller, not two, before its first token), chunked unless the caller is HTTP/1.0."""

    __slots__ = ("_chunked", "_connection", "_started", "ended", "headers", "status")

    def __init__(
        self, request: Request, status: int, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        self.status = status
        self.headers = list(headers)
        self._connection = request._connection
        self._chunked = request.http11
        self._started = False
        self.ended = False

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        for key, value in self.headers:
            if key.lower() == lowered:
                return value
        return None

    async def write(self, data: bytes) -> None:
        """Send `data` (the head first, once); ConnectionResetError when the caller left.
        Waits while the caller reads slower than we write."""
        if not data:
            return
        connection = self._connection
        framed = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        if not self._started:
            self._started = True
            framing = "Transfer-Encoding" if self._chunked else None
            framed = connection.head(self.status, self.headers, framing, None) + framed
        await connection.send(framed)

    async def end(self, last: bytes = b"") -> None:
        """The end of the answer, after `last` (in the same write): an answer not started
        yet goes whole, with its Content-Length."""
        if self.ended:
            return
        self.ended = True
        connection = self._connection
        if not self._started:
            self._started = True
            head = connection.head(self.status, self.headers, None, len(last))
            await connection.send(head + last)
        elif self._chunked:
            await connection.send(
                b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last) if last else b"0\r\n\r\n"
            )
        else:
            if last:
                await connection.send(last)
            connection.must_close = True  # HTTP/1.0: the close ends the body

    def abort(self) -> None:
        """Close the caller's connection now: its client sees a cut answer, not a short one."""
        self.ended = True
        self._connection.abort()


class Request:
    """One request, whole: the handler runs once its body is in (within the server's
    max_body_bytes: the server answers 413 itself above it)."""

    __slots__ = ("_connection", "body", "headers", "http11", "method", "path")

    def __init__(self, connection: _Connection, head: Head) -> None:
        self.method = head.method
        self.path = head.path
        self.http11 = head.http11
        self.headers = head.headers
        self.body = b""
        self._connection = connection


class _Connection(asyncio.Protocol):
    """One caller's connection: read a request, run the handler, write its answer, again."""

    def __init__(self, server: HTTP1Server) -> None:
        self._server = server
        self._loop = server.loop
        self._transport: asyncio.Transport | None = None
        self._head_buffer = bytearray()
        self._pending = bytearray()  # bytes after the current request's end
        self._request: Request | None = None
        self._task: asyncio.Task[None] | None = None
        self._body_parts: list[bytes] = []
        self._body_size = 0
        self._body_left = 0  # Content-Length bytes still to come
        self._chunks: ChunkedBody | None = None
        self._body_done = True
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
        self._server.connections.add(self)
        self._arm(IDLE_TIMEOUT_S, self._idle_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._server.connections.discard(self)
        self._disarm()
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
        if self._lingering:
            self._lingered += len(data)
            if self._lingered > MAX_LINGER_BYTES:
                self.abort()
            return
        if not self._body_done:
            self._feed_body(data)
        elif self._request is not None:
            self._pending += data  # the next request, pipelined: read once this one is done
            if len(self._pending) > MAX_HEAD_BYTES and not self._read_paused:
                self._read_paused = True
                assert self._transport is not None
                self._transport.pause_reading()
        else:
            self._read_head(data)

    def eof_received(self) -> bool | None:
        return None  # a caller that half-closes is gone: close (and cancel its handler)

    # --- reading ------------------------------------------------------------------------

    def _read_head(self, data: bytes) -> None:
        buffer = self._head_buffer
        first = not buffer
        if buffer:
            buffer += data
            data = bytes(buffer)
            buffer.clear()
        elif data[:2] == b"\r\n":
            data = data.lstrip(b"\r\n")  # blank lines before a request are allowed
        end = data.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
        if end < 0:
            if len(data) > MAX_HEAD_BYTES:
                self._refuse(HTTPError(431, f"the request head is over {MAX_HEAD_BYTES} bytes"))
            elif data:
                buffer += data
                if first:
                    self._arm(HEAD_TIMEOUT_S, self._head_expired)
            return
        try:
            head = parse_head(data[:end])
        except HTTPError as exc:
            self._refuse(exc)
            return
        if head.length is not None and head.length > self._server.max_body_bytes:
            self._refuse(self._server.too_large(head.length))
            return
        self._disarm()
        self._request = Request(self, head)
        if not head.keep_alive:
            self.must_close = True
        rest = data[end + 4 :]
        self._body_parts = []
        self._body_size = 0
        if head.chunked:
            self._chunks = ChunkedBody()
            self._body_done = False
        else:
            self._chunks = None
            self._body_left = head.length or 0
            self._body_done = not self._body_left
        if self._body_done:
            self._pending += rest
            self._start()
            return
        if head.expect_continue and not rest:
            assert self._transport is not None
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._arm(BODY_TIMEOUT_S, self._body_expired)
        if rest:
            self._feed_body(rest)

    def _feed_body(self, data: bytes) -> None:
        if self._chunks is None:
            left = self._body_left
            if len(data) > left:
                self._pending += data[left:]
                data = data[:left]
            self._body_left -= len(data)
            self._body_parts.append(data)
            if not self._body_left:
                self._body_complete()
            return
        try:
            parts = self._chunks.feed(data)
        except HTTPError as exc:
            self._refuse(exc)
            return
        self._body_parts += parts
        self._body_size += sum(map(len, parts))
        if self._body_size > self._server.max_body_bytes:
            self._refuse(self._server.too_large(self._body_size))
        elif self._chunks.done:
            self._pending += self._chunks.rest
            self._body_complete()

    def _body_complete(self) -> None:
        self._body_done = True
        self._disarm()
        self._start()

    def _start(self) -> None:
        """The request is whole: run its handler. (Not before: a handler that waited for
        the body would cost a task switch more; `Expect: 100-continue` is answered as soon
        as the head is read and its Content-Length is within the limit.)"""
        request = self._request
        assert request is not None
        parts, self._body_parts = self._body_parts, []
        request.body = parts[0] if len(parts) == 1 else b"".join(parts)
        self._task = self._loop.create_task(self._serve(request))

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
        if self._pending:
            pending = bytes(self._pending)
            self._pending.clear()
            self._read_head(pending)

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
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
        for name, value in headers:
            if not _UNSAFE_VALUE.search(value):
                lines.append(f"{name}: {value}\r\n")
        if framing is not None:
            lines.append("Transfer-Encoding: chunked\r\n")
        elif length is not None:
            lines.append(f"Content-Length: {length}\r\n")
        else:
            self.must_close = True
        request = self._request
        if self.must_close or self._server.draining:
            lines.append("Connection: close\r\n")
        elif request is not None and not request.http11:
            lines.append("Connection: keep-alive\r\n")
        lines.append(_date())
        lines.append("\r\n")
        return "".join(lines).encode("latin-1", "replace")

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
        if self._body_done and not self._lingering:
            self._closed_by_us = True
            transport.close()
            return
        self._lingering = True
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
        if self._request is None and not self._head_buffer:
            self.abort()

    def _head_expired(self) -> None:
        self._timer = None
        self._refuse(HTTPError(408, f"the request head took over {HEAD_TIMEOUT_S:g} s"))

    def _body_expired(self) -> None:
        self._timer = None
        if not self._body_done:
            self._refuse(HTTPError(408, f"the request body took over {BODY_TIMEOUT_S:g} s"))


_date_cache: tuple[int, str] = (0, "")


def _date() -> str:
    """The Date header, formatted once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, f"Date: {email.utils.formatdate(now, usegmt=True)}\r\n")
    return _date_cache[1]


class HTTP1Server:
    """The protocol factory for loop.create_server / create_unix_server, and the state its
    connections share. `error_body(status, message)` writes the body of the errors the
    server answers itself (the front's: OpenAI's shape)."""

    def __init__(self, handler: Handler, *, max_body_bytes: int, error_body: ErrorBody) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.error_body = error_body
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        self.draining = False  # set when stopping: every answer then closes its connection

    def __call__(self) -> _Connection:
        return _Connection(self)

    def error(self, status: int, message: str) -> Response:
        return Response(status, self.error_body(status, message), content_type="application/json")

    def too_large(self, size: int) -> HTTPError:
        return HTTPError(
            413,
            f"the body is over the size limit (config max_message_bytes): "
            f"{size} > {self.max_body_bytes} bytes",
        )

    def close_all(self) -> None:
        """Close every connection; a handler still running is cancelled."""
        for connection in list(self.connections):
            connection.close_now()
