"""The OpenAI front server's answers (http1): a whole `Response` with its Content-Length, or a
`StreamedResponse` written as it comes (chunked; for HTTP/1.0, ended by the close).

A header whose value has a control character (a pod's Content-Type is passed on) or whose
name is not a token is dropped, so no header can end the head or smuggle another.
"""

from __future__ import annotations

import email.utils
import http
import re
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefix_sidecar.server.openai.http1_request import Request

_UNSAFE_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_REASONS = {status.value: status.phrase for status in http.HTTPStatus}


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
            framed = connection.head(self.status, self.headers, self._chunked, None) + framed
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
            head = connection.head(self.status, self.headers, False, len(last))
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


def answer_head(
    status: int,
    headers: list[tuple[str, str]],
    chunked: bool,
    length: int | None,
    close: bool,
    http11: bool,
) -> bytes:
    """The status line and headers; the body `chunked`, else `length` for a Content-Length
    (None: the close ends the body; the caller closes).
    `close`: the connection closes after this answer."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
    for name, value in headers:
        if _TOKEN.fullmatch(name) and not _UNSAFE_VALUE.search(value):
            lines.append(f"{name}: {value}\r\n")
    if chunked:
        lines.append("Transfer-Encoding: chunked\r\n")
    elif length is not None:
        lines.append(f"Content-Length: {length}\r\n")
    if close:
        lines.append("Connection: close\r\n")
    elif not http11:
        lines.append("Connection: keep-alive\r\n")
    lines.append(_date())
    lines.append("\r\n")
    return "".join(lines).encode("latin-1", "replace")


_date_cache: tuple[int, str] = (0, "")


def _date() -> str:
    """The Date header, formatted once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, f"Date: {email.utils.formatdate(now, usegmt=True)}\r\n")
    return _date_cache[1]
