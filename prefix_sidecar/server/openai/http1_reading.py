"""The `Reading` half of the OpenAI front server's connection (http1): what llhttp is fed.

llhttp reads a head from its first byte to its blank line (found here first, so the request
line is checked and the head's size counted exactly), a Content-Length body to its last byte,
and a chunked body in steps, each ending at the latest after a CRLFCRLF (the only place a
chunked message can end). So llhttp never reads past the message in hand and each message
starts a feed. A read that starts a request is read where it lies; only the rest is buffered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httptools

from prefix_sidecar.server.openai.http1_answer import Response
from prefix_sidecar.server.openai.http1_request import (
    HTTPError,
    Request,
    RequestReader,
    check_request_line,
)

MAX_HEAD_BYTES = 16 * 1024  # the request line and headers
HEAD_TIMEOUT_S = 10.0  # from a request's first byte to its head's end
BODY_TIMEOUT_S = 60.0  # from the head's end to the body's
# A chunked body's wire bytes beyond its data: a quarter of the body limit, at least 64 KiB.
# Chunks of 28+ bytes fit ("1c\r\n" + data + "\r\n"); tiny chunks hit it before the data limit.
MAX_WIRE_OVERHEAD = 4
MIN_WIRE_OVERHEAD = 64 * 1024
# A chunked body's bytes fed per step of the loop: llhttp calls back once per chunk, and
# 64 KiB of 2-byte chunks is ~9,400 calls, ~4 ms.
CHUNKED_STEP = 64 * 1024
MAX_FEEDS_PER_STEP = 256  # a body dense with CRLFCRLF is fed up to each of them

_HEAD, _BODY, _SERVING = 0, 1, 2  # a connection's phase


class ConnectionServer(Protocol):
    """What a connection uses of its server (http1.HTTP1Server): the server's module
    imports the connection's, never the reverse."""

    @property
    def max_body_bytes(self) -> int: ...
    @property
    def max_connections(self) -> int: ...
    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...
    @property
    def connections(self) -> set[Any]: ...
    @property
    def draining(self) -> bool: ...
    @property
    def handler(self) -> Callable[[Request], Awaitable[Any]]: ...
    def error(self, status: int, message: str) -> Response: ...
    def refused(self, transport: asyncio.Transport) -> None: ...


class Reading:
    """The reading half of http1_connection.Connection (which sets these and does the rest)."""

    _server: ConnectionServer
    _loop: asyncio.AbstractEventLoop
    _transport: asyncio.Transport | None
    _reader: RequestReader
    _buffer: bytearray  # what the caller sent and llhttp has not read
    _scanned: int  # how far the head's end was looked for in _buffer
    _phase: int
    _request: Request | None
    _left: int  # Content-Length bytes still to come; for chunked, wire bytes allowed
    _raw_body: bool  # an Upgrade's body, read by its Content-Length (llhttp won't)
    _stepping: bool  # a chunked body's next step is scheduled
    _tail: bytes  # the last bytes of a chunked body fed: a CRLFCRLF may span feeds
    _timer: asyncio.TimerHandle | None
    _read_paused: bool
    _lingering: bool
    must_close: bool

    def _arm(self, seconds: float, callback: Callable[[], None]) -> None:
        raise NotImplementedError

    def _disarm(self) -> None:
        raise NotImplementedError

    def _refuse(self, error: HTTPError) -> None:
        raise NotImplementedError

    def _start(self) -> None:
        raise NotImplementedError

    def _advance(self) -> None:
        """Read what the buffer holds, as far as the current request goes."""
        try:
            if self._phase == _HEAD:
                self._read_head()
            if self._phase == _BODY:
                self._read_body()
        except HTTPError as exc:
            self._refuse(exc)

    def _read_fresh(self, data: bytes) -> None:
        """A read that starts a request, nothing buffered: its head and a Content-Length
        body are read from it as they lie, with no copy into the buffer."""
        end = data.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
        if end < 0 or data[:2] == b"\r\n":
            self._buffer += data
            self._advance()
            return
        try:
            self._head(data[: end + 4])
            rest = memoryview(data)[end + 4 :]
            if self._phase == _BODY and not self._reader.chunked and not self._stepping:
                self._body_direct(rest)
            elif rest:
                self._buffer += rest
                self._advance()
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
        self._head(head)

    def _head(self, head: bytes) -> None:
        """A whole head, its blank line included: read, then the body's reading set up."""
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
        if reader.expect_continue and not self._buffer:
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

    def _body_direct(self, data: bytes | memoryview) -> None:
        """A Content-Length body's bytes as they came (what follows it is buffered)."""
        left = self._left
        if len(data) > left:
            self._buffer += data[left:]
            data = data[:left]
        if data:
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
        if self._phase == _BODY and not self._stepping:
            self._resume_reading()

    def _feed_body(self, data: bytes | memoryview) -> None:
        """A Content-Length body's next bytes (at most what is left of it)."""
        self._left -= len(data)
        reader = self._reader
        if self._raw_body:
            reader.on_body(bytes(data))  # counted and kept as llhttp's would be
            if not self._left:
                self._body_complete()
            return
        reader.feed(data)
        if reader.complete:
            self._body_complete()

    def _body_complete(self) -> None:
        self._disarm()
        self._start()

    def _pause_reading(self) -> None:
        if not self._read_paused and self._transport is not None:
            self._read_paused = True
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._read_paused and self._transport is not None:
            self._read_paused = False
            self._transport.resume_reading()

    def _head_expired(self) -> None:
        self._timer = None
        self._refuse(HTTPError(408, f"the request head took over {HEAD_TIMEOUT_S:g} s"))

    def _body_expired(self) -> None:
        self._timer = None
        if self._phase == _BODY:
            self._refuse(HTTPError(408, f"the request body took over {BODY_TIMEOUT_S:g} s"))
