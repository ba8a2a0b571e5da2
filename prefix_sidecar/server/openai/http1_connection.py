"""One caller's connection to the OpenAI front's server (prefix_sidecar.server.openai.http1):
its lifecycle, its answers and its timers; how it reads a request is http1_reading."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prefix_sidecar.server.openai.http1_answer import Response, answer_head
from prefix_sidecar.server.openai.http1_reading import (
    _BODY,
    _HEAD,
    _SERVING,
    MAX_HEAD_BYTES,
    ConnectionServer,
    Reading,
)
from prefix_sidecar.server.openai.http1_request import HTTPError, Request, RequestReader

logger = logging.getLogger("prefix_sidecar.server.openai.http1")

IDLE_TIMEOUT_S = 75.0  # a kept-alive connection with no request
WRITE_STALL_S = 60.0  # a caller that reads none of its answer for this long is dropped
LINGER_S = 2.0  # reading and dropping a refused body before the close
MAX_LINGER_BYTES = 64 * 1024 * 1024


class Connection(Reading, asyncio.Protocol):
    """One caller's connection: read a request, run the handler, write its answer, again."""

    def __init__(self, server: ConnectionServer) -> None:
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
        if not self._buffer:
            if self._phase == _HEAD:
                self._read_fresh(data)  # read where it lies: no copy into the buffer
                return
            if self._phase == _BODY and not self._reader.chunked:
                self._body_direct(data)
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

    # --- reading: http1_reading.Reading, but for the start of the handler ---

    def _start(self) -> None:
        """The request is whole: run its handler (only now, saving a task switch;
        `Expect: 100-continue` was answered at the head)."""
        request = self._request
        assert request is not None
        request.body = self._reader.body()
        self._phase = _SERVING
        self._raw_body = False
        self._reader.reset()
        if len(self._buffer) > MAX_HEAD_BYTES:
            self._pause_reading()
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
        head = self.head(answer.status, answer.headers, False, len(body))
        transport.write(head if request.method == "HEAD" or not body else head + body)

    def _finish(self) -> None:
        """The answer is out: the next request (already here, maybe), or the close."""
        self._request = None
        self._task = None
        self._answer_started = False
        self._phase = _HEAD
        if self._transport is None:
            return
        if self.must_close or self._server.draining:
            self._close_after_answer()
            return
        self._arm(IDLE_TIMEOUT_S, self._idle_expired)
        self._resume_reading()
        if self._buffer:
            self._advance()

    def head(
        self,
        status: int,
        headers: list[tuple[str, str]],
        chunked: bool,
        length: int | None,
    ) -> bytes:
        """The status line and headers; the body `chunked`, else `length` for a
        Content-Length (None: the close ends the body)."""
        self._answer_started = True
        if not chunked and length is None:
            self.must_close = True
        request = self._request
        close = self.must_close or self._server.draining
        return answer_head(
            status, headers, chunked, length, close, request is None or request.http11
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
            self.head(answer.status, answer.headers, False, len(answer.body)) + answer.body
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
        self._resume_reading()
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
