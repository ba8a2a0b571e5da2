"""The pool of keep-alive connections to the pods, and their answers (PodAnswer).

Everything the sidecar sends to a pod goes through here (prefix_sidecar.upstream.client): a
direct asyncio connection reaches the first byte sooner than aiohttp (docs/benchmarks.md).
Answers are parsed by llhttp (prefix_sidecar.upstream.pod_connection); an `https://` pod uses
asyncio's TLS transport, verified against `tls_context` (default: the system trust store,
which honours SSL_CERT_FILE) and the pod's host name.

A connection is reused only after an answer read to its end, not asking to close, and followed
by no byte: a byte past the answer could be read as the next caller's, so that connection is
closed and counted (`on_unasked`), as nginx does. An idle one is dropped after IDLE_S. A
request on a reused connection the pod had closed is sent once more on a new one.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple
from urllib.parse import urlsplit

from prefix_sidecar.upstream.pod_connection import PodConnection, PodHTTPError

IDLE_S = 4.0  # under uvicorn's (vLLM's server) 5 s idle close


class _Address(NamedTuple):
    host: str
    port: int
    netloc: bytes  # the Host header
    tls: bool


class _StaleConnection(Exception):
    """A reused connection the pod had closed: no answer was read, send again."""


class PodAnswer:
    """A pod's answer, the one type both fronts read: its final status and headers (names
    lowercased), then `read()` its body in the pieces the socket gives; `close()` keeps the
    connection only for an answer read whole, then frees the pod's connection slot."""

    def __init__(
        self,
        pool: LeanHTTP,
        connection: PodConnection,
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
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._per_backend = per_backend
        self._on_unasked = on_unasked
        self._tls_context = tls_context
        self._idle: dict[str, list[PodConnection]] = {}
        self._addresses: dict[str, _Address] = {}

    async def send(
        self,
        method: str,
        backend: str,
        path: str,
        body: Sequence[bytes],
        headers: Mapping[str, str],
        *,
        deadline: float | None,
        on_close: Callable[[], None],
    ) -> PodAnswer:
        """Send the request (`body` in parts) and return its answer once its final status
        and headers are in. `on_close` runs when the answer is closed."""
        lines = [method.encode("ascii"), b" ", path.encode("ascii"), b" HTTP/1.1\r\nHost: "]
        lines.append(self._address(backend).netloc)
        lines.append(b"\r\nContent-Length: %d\r\n" % sum(len(part) for part in body))
        for name, value in headers.items():
            # A caller's header that latin-1 cannot hold reaches the pod with `?` (its key is
            # then wrong, and the pod's 401 says so) rather than failing the request here.
            encoded = value.encode("latin-1", "replace")
            lines += (name.encode("latin-1", "replace"), b": ", encoded, b"\r\n")
        lines.append(b"\r\n")
        request = [b"".join(lines), *body]
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
        connection: PodConnection,
        request: list[bytes],
        deadline: float | None,
        on_close: Callable[[], None],
        *,
        again: bool,
    ) -> PodAnswer:
        connection.start(request)
        try:
            while not connection.head_done:
                error = connection.error
                if error is not None:
                    if again and connection.lost and not connection.received:
                        raise _StaleConnection
                    raise error
                try:
                    await connection.wait(deadline)
                except TimeoutError:
                    raise PodHTTPError("the upstream timeout expired before the answer") from None
        except BaseException:
            self.finish(connection, reusable=False)
            raise
        return PodAnswer(self, connection, deadline, on_close)

    async def _connect(self, backend: str, deadline: float | None) -> PodConnection:
        address = self._address(backend)
        loop = asyncio.get_running_loop()
        timeout = self._connect_timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - loop.time())
        connection = PodConnection(backend)
        tls = self._tls() if address.tls else None
        try:
            async with asyncio.timeout(max(timeout, 0.001)):
                await loop.create_connection(
                    lambda: connection,
                    address.host,
                    address.port,
                    ssl=tls,
                    server_hostname=address.host if tls else None,
                )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError (a certificate refused) too
            raise PodHTTPError(
                f"cannot connect: {_connect_error(exc)}"[:300], connection_failure=True
            ) from None
        return connection

    def _tls(self) -> ssl.SSLContext:
        """The context `https://` pods are verified with; the system's, made on first use
        (loading the trust store takes milliseconds)."""
        if self._tls_context is None:
            self._tls_context = ssl.create_default_context()
        return self._tls_context

    def _take_idle(self, backend: str) -> PodConnection | None:
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

    def finish(self, connection: PodConnection, *, reusable: bool) -> None:
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

    def _count_unasked(self, connection: PodConnection) -> None:
        connection.unasked = False  # counted once
        connection.lost = True
        if self._on_unasked is not None:
            self._on_unasked(connection.backend)

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.abort()
        self._idle.clear()

    def _address(self, backend: str) -> _Address:
        found = self._addresses.get(backend)
        if found is None:
            if len(self._addresses) > 4096:  # pods come and go: keep the table bounded
                self._addresses.clear()
            url = urlsplit(backend)
            tls = url.scheme == "https"
            found = self._addresses[backend] = _Address(
                url.hostname or "",
                url.port or (443 if tls else 80),
                url.netloc.encode("ascii"),
                tls,
            )
        return found


def _connect_error(exc: OSError | TimeoutError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"  # asyncio's text ("Connect call failed") hides this
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the pod's TLS certificate does not verify: {exc.verify_message}"
    return f"{exc.__class__.__name__}: {exc}"
