"""A lean HTTP/1.1 client for the OpenAI front's pod requests: one write out, bytes back.

The HTTP front relays a caller's body and the pod's answer as bytes, so it needs no more of
HTTP than a request line, a few headers and the answer's framing. aiohttp's client took
0.3-1.2 ms longer than this to the first byte of the same pod's answer to the same 240 KB
body (docs/benchmarks.md, the HTTP front), most of the front's remaining cost over the
store-and-forward floor. The gRPC front keeps aiohttp (UpstreamClient); `https://` pods go
through it too, so TLS stays aiohttp's.

Everything a pod sends is bounded: its status line and headers together (MAX_HEAD), a
chunk-size line (the same reader limit), a body read in pieces of at most READ_PIECE, and
the whole answer by the caller's deadline (`timeout_s`). A connection is reused only after
an answer read to its end that did not ask to close; an idle one is dropped after IDLE_S
(uvicorn, vLLM's server, closes idle connections at 5 s). A request on a reused connection
that the pod had closed meanwhile is sent again once on a new connection, as no answer of
it was read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

READ_PIECE = 64 * 1024
MAX_HEAD = 64 * 1024
MAX_TRAILER_LINES = 64
MAX_INTERIM = 4  # 1xx answers skipped before the real one
IDLE_S = 4.0


class PodHTTPError(Exception):
    """The pod's answer could not be read: broken, malformed or over a bound."""

    def __init__(self, message: str, *, connection_failure: bool = False) -> None:
        super().__init__(message)
        self.connection_failure = connection_failure


class _StaleConnection(Exception):
    """A reused connection the pod had closed: no answer was read, send again."""


class LeanAnswer:
    """One answer: its status and headers (names lowercased), then `read()` its body."""

    def __init__(
        self,
        pool: LeanHTTP,
        backend: str,
        connection: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        status: int,
        headers: dict[str, str],
        deadline: float,
        slot: asyncio.Semaphore,
    ) -> None:
        self._pool = pool
        self._slot = slot
        self._backend = backend
        self._reader, self._writer = connection
        self.status = status
        self.headers = headers
        self._deadline = deadline
        encoding = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in encoding
        self._left: int | None = None  # bytes of body (or of the current chunk) still to read
        if not self._chunked and "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise PodHTTPError(f"a malformed Content-Length: {length[:40]!r}")
            self._left = int(length)
        self._reusable = "close" not in headers.get("connection", "").lower()
        self._delimited = self._chunked or self._left is not None
        self.done = self._left == 0
        self._open = True

    async def read(self) -> bytes:
        """The next piece of the body as the pod's socket gives it; b"" at its end."""
        if self.done:
            return b""
        try:
            async with asyncio.timeout_at(self._deadline):
                return await self._next()
        except TimeoutError:
            raise PodHTTPError("the upstream timeout expired mid-answer") from None
        except asyncio.IncompleteReadError:
            raise PodHTTPError("the pod closed the connection mid-answer") from None
        except (asyncio.LimitOverrunError, ValueError):
            raise PodHTTPError("the pod's chunked framing is malformed") from None
        except OSError as exc:
            raise PodHTTPError(f"the answer broke: {exc.__class__.__name__}") from None

    async def _next(self) -> bytes:
        reader = self._reader
        if self._chunked:
            if not self._left:
                size = int(bytes(await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size < 0:
                    raise ValueError(size)
                if size == 0:
                    for _ in range(MAX_TRAILER_LINES):
                        if await reader.readuntil(b"\r\n") == b"\r\n":
                            self.done = True
                            return b""
                    raise ValueError("too many trailer lines")
                self._left = size
            data = await reader.read(min(self._left, READ_PIECE))
            if not data:
                raise asyncio.IncompleteReadError(b"", self._left)
            self._left -= len(data)
            if not self._left and await reader.readexactly(2) != b"\r\n":
                raise ValueError("a chunk without its CRLF")
            return data
        if self._left is not None:
            data = await reader.read(min(self._left, READ_PIECE))
            if not data:
                raise asyncio.IncompleteReadError(b"", self._left)
            self._left -= len(data)
            self.done = not self._left
            return data
        data = await reader.read(READ_PIECE)  # delimited by the connection's end
        self.done = not data
        return data

    def close(self) -> None:
        """Give the connection back when the answer was read whole, else close it (a pod
        request still running ends: vLLM aborts it)."""
        if not self._open:
            return
        self._open = False
        self._slot.release()
        if self.done and self._delimited and self._reusable:
            self._pool.give_back(self._backend, (self._reader, self._writer))
        else:
            self._writer.transport.abort()


class LeanHTTP:
    """Keep-alive connections per pod: at most `per_backend` answers open at once to each
    (more requests wait for one to close), and no more idle connections than that."""

    def __init__(self, *, connect_timeout_s: float, per_backend: int) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._per_backend = per_backend
        self._idle: dict[str, list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}  # requests at once, per pod
        self._addresses: dict[str, tuple[str, int, bytes]] = {}

    @staticmethod
    def serves(backend: str) -> bool:
        return backend.startswith("http://")

    async def post(
        self,
        backend: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        timeout_s: float,
    ) -> LeanAnswer:
        """Send the request and return its answer once the status and headers are in."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        request = self._request(backend, path, body, headers)
        slots = self._slots.get(backend)
        if slots is None:
            if len(self._slots) > 4096:  # pods come and go: keep the table bounded
                self._slots.clear()
            slots = self._slots[backend] = asyncio.Semaphore(self._per_backend)
        async with asyncio.timeout_at(deadline):
            await slots.acquire()  # held by the answer until it is closed
        try:
            reused = self._take_idle(backend)
            if reused is not None:
                with contextlib.suppress(_StaleConnection):
                    return await self._exchange(
                        backend, reused, request, deadline, slots, again=True
                    )
            connection = await self._connect(backend, deadline)
            return await self._exchange(backend, connection, request, deadline, slots, again=False)
        except BaseException:
            slots.release()
            raise

    async def _exchange(
        self,
        backend: str,
        connection: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        request: list[bytes],
        deadline: float,
        slot: asyncio.Semaphore,
        *,
        again: bool,
    ) -> LeanAnswer:
        reader, writer = connection
        try:
            async with asyncio.timeout_at(deadline):
                writer.writelines(request)
                head = await reader.readuntil(b"\r\n\r\n")
                for _ in range(MAX_INTERIM):  # a 1xx is not the answer: the next head is
                    if not head.startswith(b"HTTP/1.1 1"):
                        break
                    head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            writer.transport.abort()
            if again and (not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial):
                raise _StaleConnection from None
            raise PodHTTPError(
                f"the pod closed the connection before answering ({exc.__class__.__name__})",
                connection_failure=True,
            ) from None
        except (asyncio.LimitOverrunError, ValueError):
            writer.transport.abort()
            raise PodHTTPError(f"the answer's headers are over {MAX_HEAD} bytes") from None
        except BaseException:
            writer.transport.abort()
            raise
        try:
            status, answer_headers = _parse_head(head)
            return LeanAnswer(self, backend, connection, status, answer_headers, deadline, slot)
        except PodHTTPError:
            writer.transport.abort()
            raise

    async def _connect(
        self, backend: str, deadline: float
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port, _ = self._address(backend)
        timeout = min(self._connect_timeout_s, deadline - asyncio.get_running_loop().time())
        try:
            async with asyncio.timeout(max(timeout, 0.001)):
                connection = await asyncio.open_connection(host, port, limit=MAX_HEAD)
        except (OSError, TimeoutError) as exc:
            raise PodHTTPError(
                f"cannot connect: {exc.__class__.__name__}: {exc}"[:300], connection_failure=True
            ) from None
        return connection

    def _take_idle(self, backend: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        idle = self._idle.get(backend)
        now = time.monotonic()
        while idle:
            since, reader, writer = idle.pop()
            if now - since < IDLE_S and not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.transport.abort()
        return None

    def give_back(
        self, backend: str, connection: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    ) -> None:
        if len(self._idle) > 4096:  # pods come and go: keep the table bounded
            self.close()
        self._idle.setdefault(backend, []).append((time.monotonic(), *connection))

    def close(self) -> None:
        for idle in self._idle.values():
            for _, _, writer in idle:
                writer.transport.abort()
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
        self, backend: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> list[bytes]:
        _, _, netloc = self._address(backend)
        lines = [b"POST ", path.encode("ascii"), b" HTTP/1.1\r\nHost: ", netloc]
        lines.append(b"\r\nContent-Length: %d\r\n" % len(body))
        for name, value in headers.items():
            # A caller's header that latin-1 cannot hold reaches the pod with `?` (its key is
            # then wrong, and the pod's 401 says so) rather than failing the request here.
            encoded = value.encode("latin-1", "replace")
            lines += (name.encode("latin-1", "replace"), b": ", encoded, b"\r\n")
        lines.append(b"\r\n")
        return [b"".join(lines), body]


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """The status and headers (names lowercased; a repeated one keeps its last value)."""
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise PodHTTPError(f"not an HTTP/1.1 status line: {lines[0][:60]!r}")
    headers = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise PodHTTPError("a malformed header line in the pod's answer")
        headers[name.decode("latin-1").lower()] = value.strip().decode("latin-1")
    if lines[0].startswith(b"HTTP/1.0") and "keep-alive" not in headers.get("connection", ""):
        headers["connection"] = "close"
    return int(parts[1]), headers
