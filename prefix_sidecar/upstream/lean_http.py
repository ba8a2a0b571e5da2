"""The HTTP/1.1 client for `http://` pods: one write out, the answer parsed by llhttp.

Both fronts send to `http://` pods through here (prefix_sidecar.upstream.client.post);
`https://` pods go through aiohttp, so TLS stays aiohttp's. aiohttp's client took 0.3-1.2
ms longer than a direct asyncio connection to the first byte of the same pod's answer to
the same 240 KB body (docs/benchmarks.md, the HTTP front). Each connection is an
asyncio.Protocol that hands every byte to `httptools.HttpResponseParser` (llhttp, Node's
parser, as uvicorn does): the protocol never splits a line itself. llhttp already rejects
a Content-Length that is not digits (`²`, `+5`) or that repeats, CL beside TE, a chunk size
that is not bare hex (`0x1f`, `1_f`, blanks), a bare LF in a chunk extension, control
characters in a header value and a status that is not three digits.

What llhttp accepts and a pod may not send is refused here, as a PodHTTPError (a failure of
that pod: the relay fails over): a status outside 100-599, a version other than 1.0 and 1.1,
a Transfer-Encoding other than `chunked`, a protocol switch, more than MAX_INTERIM 1xx
answers, headers (or trailers) over MAX_HEAD bytes.

A connection is reused only after an answer read to its end, that did not ask to close, and
after which the pod sent nothing: a byte past the answer (a second, unasked answer, a 204's
body) could be read as the next caller's answer, so that connection is closed and counted
(`on_unasked`), as nginx does ("upstream sent more data than specified"). An idle one is
dropped after IDLE_S (uvicorn, vLLM's server, closes idle connections at 5 s). A request on
a reused connection that the pod had closed meanwhile is sent again once on a new one, as no
answer of it was read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

import httptools

# Body bytes buffered before the socket stops being read (resumed as they are read).
HIGH_WATER = 256 * 1024
MAX_HEAD = 64 * 1024
MAX_INTERIM = 4  # 1xx answers skipped before the real one
IDLE_S = 4.0
VERSIONS = ("1.0", "1.1")


class PodHTTPError(Exception):
    """The pod's answer could not be read: broken, malformed or over a bound."""

    def __init__(self, message: str, *, connection_failure: bool = False) -> None:
        super().__init__(message)
        self.connection_failure = connection_failure


class _StaleConnection(Exception):
    """A reused connection the pod had closed: no answer was read, send again."""


class _Unasked(Exception):
    """The pod began another answer after the one asked for."""


class _Connection(asyncio.Protocol):
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
        self.transport.writelines(request)

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


class LeanAnswer:
    """One answer: its status and headers (names lowercased), then `read()` its body."""

    def __init__(
        self,
        pool: LeanHTTP,
        connection: _Connection,
        deadline: float | None,
        on_close: Callable[[], None],
    ) -> None:
        self._pool = pool
        self._connection = connection
        self._deadline = deadline
        self._on_close = on_close
        self.status = connection.status
        self.headers: Mapping[str, str] = connection.headers
        self._open = True

    @property
    def done(self) -> bool:
        """Read to its end: nothing more will come."""
        connection = self._connection
        return connection.complete and not connection.pending

    async def read(self) -> bytes:
        """The body bytes that arrived since the last read; b"" at its end."""
        connection = self._connection
        while True:
            if connection.pending:
                data = b"".join(connection.pending)
                connection.pending.clear()
                connection.buffered = 0
                if connection.transport is not None and not connection.lost:
                    connection.transport.resume_reading()
                return data
            if connection.error is not None:
                raise connection.error
            if connection.complete:
                return b""
            try:
                await connection.wait(self._deadline)
            except TimeoutError:
                raise PodHTTPError("the upstream timeout expired mid-answer") from None

    def close(self) -> None:
        """Give the connection back when the answer was read whole, else close it (a pod
        request still running ends: vLLM aborts it)."""
        if not self._open:
            return
        self._open = False
        self._pool.finish(self._connection, reusable=self.done)
        self._on_close()


class LeanHTTP:
    """Keep-alive connections per pod, at most `per_backend` of them idle. How many are open
    at once is the caller's budget (UpstreamClient's, one per pod)."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        per_backend: int,
        on_unasked: Callable[[str], None] | None = None,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._per_backend = per_backend
        self._on_unasked = on_unasked
        self._idle: dict[str, list[_Connection]] = {}
        self._addresses: dict[str, tuple[str, int, bytes]] = {}
        self.unasked_closed = 0

    @staticmethod
    def serves(backend: str) -> bool:
        return backend.startswith("http://")

    async def post(
        self,
        backend: str,
        path: str,
        body: Sequence[bytes],
        headers: Mapping[str, str],
        *,
        deadline: float | None,
        on_close: Callable[[], None],
    ) -> LeanAnswer:
        """Send the request (`body` in parts) and return its answer once its final status
        and headers are in. `on_close` runs when the answer is closed."""
        request = self._request(backend, path, body, headers)
        reused = self._take_idle(backend)
        if reused is not None:
            try:
                return await self._exchange(reused, request, deadline, on_close, again=True)
            except _StaleConnection:
                pass
        connection = await self._connect(backend, deadline)
        return await self._exchange(connection, request, deadline, on_close, again=False)

    async def _exchange(
        self,
        connection: _Connection,
        request: list[bytes],
        deadline: float | None,
        on_close: Callable[[], None],
        *,
        again: bool,
    ) -> LeanAnswer:
        connection.start(request)
        try:
            while not connection.head_done:
                error = connection.error
                if error is not None:
                    if again and connection.lost and not connection.received:
                        raise _StaleConnection
                    raise error
                await connection.wait(deadline)
        except BaseException:
            self.finish(connection, reusable=False)
            raise
        return LeanAnswer(self, connection, deadline, on_close)

    async def _connect(self, backend: str, deadline: float | None) -> _Connection:
        host, port, _ = self._address(backend)
        loop = asyncio.get_running_loop()
        timeout = self._connect_timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - loop.time())
        connection = _Connection(backend)
        try:
            async with asyncio.timeout(max(timeout, 0.001)):
                await loop.create_connection(lambda: connection, host, port)
        except (OSError, TimeoutError) as exc:
            raise PodHTTPError(
                f"cannot connect: {exc.__class__.__name__}: {exc}"[:300], connection_failure=True
            ) from None
        return connection

    def _take_idle(self, backend: str) -> _Connection | None:
        idle = self._idle.get(backend)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.unasked:
                self._count_unasked(connection)
            elif now - connection.idle_since < IDLE_S and not connection.lost:
                return connection
            connection.abort()
        return None

    def finish(self, connection: _Connection, *, reusable: bool) -> None:
        """An answer closed: its connection back to the idle list, or closed."""
        if connection.unasked:
            self._count_unasked(connection)
        idle = self._idle.get(connection.backend)
        if (
            not reusable
            or connection.unasked
            or not connection.keep_alive
            or connection.lost
            or (idle is not None and len(idle) >= self._per_backend)
        ):
            connection.abort()
            return
        if len(self._idle) > 4096:  # pods come and go: keep the table bounded
            self.close()
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.backend, []).append(connection)

    def _count_unasked(self, connection: _Connection) -> None:
        connection.unasked = False  # counted once
        connection.lost = True
        self.unasked_closed += 1
        if self._on_unasked is not None:
            self._on_unasked(connection.backend)

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.abort()
        self._idle.clear()

    def _address(self, backend: str) -> tuple[str, int, bytes]:
        found = self._addresses.get(backend)
        if found is None:
            if len(self._addresses) > 4096:  # pods come and go: keep the table bounded
                self._addresses.clear()
            url = urlsplit(backend)
            host, port = url.hostname or "", url.port or 80
            found = self._addresses[backend] = (host, port, url.netloc.encode("ascii"))
        return found

    def _request(
        self, backend: str, path: str, body: Sequence[bytes], headers: Mapping[str, str]
    ) -> list[bytes]:
        _, _, netloc = self._address(backend)
        lines = [b"POST ", path.encode("ascii"), b" HTTP/1.1\r\nHost: ", netloc]
        lines.append(b"\r\nContent-Length: %d\r\n" % sum(len(part) for part in body))
        for name, value in headers.items():
            # A caller's header that latin-1 cannot hold reaches the pod with `?` (its key is
            # then wrong, and the pod's 401 says so) rather than failing the request here.
            encoded = value.encode("latin-1", "replace")
            lines += (name.encode("latin-1", "replace"), b": ", encoded, b"\r\n")
        lines.append(b"\r\n")
        return [b"".join(lines), *body]
