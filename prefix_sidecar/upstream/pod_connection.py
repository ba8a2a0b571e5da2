"""One keep-alive connection to a pod: an asyncio.Protocol whose bytes all go to llhttp
(`httptools.HttpResponseParser`, as uvicorn), so no line is split here.

llhttp refuses a bad Content-Length (not digits, repeated, beside Transfer-Encoding), a chunk
size that is not bare hex, a bare LF in a chunk extension, control characters in a header
value and a status that is not three digits. What it accepts and a pod may not send is a
PodHTTPError here (the relay fails over): a status outside 100-599, a version other than 1.0
and 1.1, a Transfer-Encoding other than `chunked`, a protocol switch, over MAX_INTERIM 1xx
answers, framing without a body byte (headers, chunk lines, trailers) over MAX_HEAD bytes.
Past HIGH_WATER buffered body bytes the socket stops being read. A byte past the answer, whenever
it comes, marks the connection `unasked`: never reused (lean_http counts it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httptools

# Body bytes buffered before the socket stops being read (resumed as they are read).
HIGH_WATER = 256 * 1024
MAX_HEAD = 64 * 1024
MAX_INTERIM = 4  # 1xx answers skipped before the real one
VERSIONS = ("1.0", "1.1")


class PodHTTPError(Exception):
    """The pod's answer could not be read: broken, malformed or over a bound."""

    def __init__(self, message: str, *, connection_failure: bool = False) -> None:
        super().__init__(message)
        self.connection_failure = connection_failure


class _Unasked(Exception):
    """The pod began another answer after the one asked for."""


class PodConnection(asyncio.Protocol):
    """One keep-alive connection to a pod and the answer being read on it (llhttp's
    callbacks land here)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.unasked = False  # the pod sent bytes past an answer: never reuse
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.pending: list[bytes] = []
        self.buffered = 0
        self.error: PodHTTPError | None = None
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False  # a byte of this answer arrived
        self._head_bytes = 0
        self._quiet = 0  # bytes read since the head or the last body byte
        self._progress = False
        self._interim = 0
        self._waiter: asyncio.Future[None] | None = None

    def start(self, request: Sequence[bytes]) -> None:
        """Send a request; its answer is read from here on."""
        self._reset()
        assert self.transport is not None
        self.transport.resume_reading()  # a no-op unless a body had paused it
        # Part by part: writelines joins them into one new buffer first (an 8 MiB body's join
        # held the loop ~15 ms); write() sends each from its own bytes.
        for part in request:
            self.transport.write(part)

    async def wait(self, deadline: float | None) -> None:
        """Until something new: the head, body bytes, the end, an error."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout_at(deadline):
                await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, message: str) -> None:
        if self.error is None and not self.complete:
            self.error = PodHTTPError(message, connection_failure=True)
        self.abort()
        self._wake()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.error is not None:
            return
        if self.complete:
            self.unasked = True  # bytes nobody asked for: this connection is not reused
            self.abort()
            return
        self.received = True
        self._progress = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail("the pod switched protocols (101): not an answer")
        except httptools.HttpParserError as exc:
            if self.unasked:
                self.abort()  # the answer asked for is whole; the connection goes
            else:
                self._fail(f"the pod's answer is malformed: {_cause(exc)}"[:300])
        if self._progress or self.complete:
            self._quiet = 0
        else:  # framing and no body byte: a head, chunk lines, trailers
            self._quiet += len(data)
            if self._quiet > MAX_HEAD:
                self._fail(f"the answer's headers are over {MAX_HEAD} bytes")
        if self.buffered > HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.complete and self.error is None:
            if self.head_done and self._until_close():
                self.complete = True  # a body delimited by the connection's end
            elif self.received:
                self.error = PodHTTPError("the pod closed the connection mid-answer")
            else:
                self.error = PodHTTPError(
                    "the pod closed the connection before answering", connection_failure=True
                )
        self._wake()

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            self.unasked = True
            raise _Unasked

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD:
            raise PodHTTPError(f"the answer's headers are over {MAX_HEAD} bytes")
        if not self.head_done:
            self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if parser.get_http_version() not in VERSIONS:
            raise PodHTTPError(f"not an HTTP/1.1 answer (HTTP/{parser.get_http_version()})")
        if not 100 <= status <= 599:
            raise PodHTTPError(f"the pod answered status {status}, not a valid HTTP status")
        encoding = self.headers.get("transfer-encoding")
        if encoding is not None and encoding.strip().lower() != "chunked":
            raise PodHTTPError(f"an unsupported Transfer-Encoding: {encoding[:40]!r}")
        self.status = status
        if status >= 200:
            self.head_done = True
            self._head_bytes = 0  # trailers get a bound of their own
            self._progress = True
            self._wake()

    def on_body(self, body: bytes) -> None:
        self.pending.append(body)
        self.buffered += len(body)
        self._progress = True
        self._wake()

    def on_message_complete(self) -> None:
        if not self.head_done:  # an interim 1xx: the real answer comes next
            self._interim += 1
            if self._interim > MAX_INTERIM:
                raise PodHTTPError(f"more than {MAX_INTERIM} interim 1xx answers")
            self.headers = {}
            self._head_bytes = 0
            return
        self.keep_alive = self._parser.should_keep_alive()
        self.complete = True
        self._wake()

    def _until_close(self) -> bool:
        return (
            "content-length" not in self.headers
            and "transfer-encoding" not in self.headers
            and self.status not in (204, 304)
        )


def _cause(exc: httptools.HttpParserError) -> str:
    """llhttp's reason, or ours when a callback raised."""
    cause = exc.__context__
    return str(cause) if isinstance(cause, PodHTTPError) else str(exc)
