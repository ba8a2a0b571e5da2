"""One connection's requests as llhttp (httptools) reads them, with the checks it leaves out.

All of it is untrusted. llhttp enforces the framing (token header names, no folding, no control
character but tab in a value, one numeric Content-Length never beside Transfer-Encoding, hex
chunk sizes, CRLF). `RequestReader` adds (each covered in tests/server/openai/test_http1.py):
- the request line: single spaces, a method of <= 32 token chars, a target of 1-8,192 visible
  ASCII chars (a path or absolute http(s) URL), HTTP/1.1 or 1.0 only (505);
- <= MAX_HEADERS header lines and MAX_TRAILER_BYTES of trailers (431); body bytes (413);
- Transfer-Encoding only `chunked`, only on HTTP/1.1 (501); Expect only `100-continue` (417);
- values' trailing blanks dropped, a repeated header's values joined.
Errors are HTTPError with the status to answer; their messages quote nothing the caller sent.
"""

from __future__ import annotations

import re
from typing import Any

import httptools

MAX_HEADERS = 100
MAX_TRAILER_BYTES = 16 * 1024
_METHOD = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}")
_TARGET = re.compile(rb"[\x21-\x7e]{1,8192}")


class HTTPError(Exception):
    """A request the server answers itself with `status` (the connection then closes)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Request:
    """One request, whole: the handler runs once its body is in (within the server's
    max_body_bytes: the server answers 413 itself above it)."""

    __slots__ = ("_connection", "body", "headers", "http11", "method", "path")

    def __init__(
        self, connection: Any, method: str, path: str, http11: bool, headers: dict[str, str]
    ) -> None:
        self.method = method
        self.path = path  # without the query
        self.http11 = http11
        self.headers = headers  # names lowercased; a repeated header's values joined by ", "
        self.body = b""
        self._connection: Any = connection  # its http1_connection.Connection, which answers it


def check_request_line(head: bytes) -> None:
    """The request line's rules llhttp does not enforce; `head` starts with it."""
    end = head.find(b"\r\n")
    parts = head[: end if end >= 0 else len(head)].split(b" ")
    if len(parts) != 3 or not _METHOD.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
        raise HTTPError(400, "a malformed request line")
    if parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise HTTPError(505, "only HTTP/1.1 and HTTP/1.0 are served")
    if head.count(b"\r\n") > MAX_HEADERS + 2:  # the request line's and the blank line's
        raise HTTPError(431, f"more than {MAX_HEADERS} header lines")


def _path(target: bytes) -> str:
    path = target.split(b"?", 1)[0]
    if not path.startswith(b"/"):
        # The absolute form (a proxy's): http://host/path; anything else is no path here.
        scheme, _, rest = path.partition(b"://")
        if scheme.lower() not in (b"http", b"https") or not rest:
            raise HTTPError(400, "a request target must be a path")
        path = b"/" + rest.partition(b"/")[2]
    return path.decode("ascii")


class _Stop(Exception):
    """Raised from a callback to stop llhttp where it is (the reason is in `error`)."""


class RequestReader:
    """The parser of one connection and the state of the message it is reading. `feed`
    bytes: the head first (`headers_done`, `request`), then the body (`complete`). A
    message that begins in the same feed as the one before it ended sets `overrun`."""

    def __init__(self, connection: Any, max_body_bytes: int) -> None:
        self._connection = connection
        self._max_body = max_body_bytes
        self._parser = httptools.HttpRequestParser(self)
        self.reset()

    def reset(self) -> None:
        self.request: Request | None = None
        self.headers_done = False
        self.complete = False
        self.overrun = False
        self.error: HTTPError | None = None
        self.keep_alive = True
        self.chunked = False
        self.length = 0  # Content-Length
        self.expect_continue = False
        self.body_size = 0
        self._url = b""
        self._headers: dict[str, str] = {}
        self._trailer_bytes = 0
        # A Content-Length body's pieces (one per read, joined once); a chunked body's
        # bytes in one bytearray (a piece per chunk could be one per 2 bytes).
        self._pieces: list[bytes] = []
        self._chunks = bytearray()

    def body(self) -> bytes:
        if self.chunked:
            return bytes(self._chunks)
        pieces = self._pieces
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def feed(self, data: bytes | memoryview) -> None:
        """HTTPError for what the server must refuse; httptools.HttpParserUpgrade when
        llhttp takes the rest of the connection for another protocol."""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self.error is not None:
                raise self.error from None
            raise
        except httptools.HttpParserCallbackError:
            if self.overrun and self.complete:
                return  # the next message is read later, from its first byte
            if self.error is not None:
                raise self.error from None
            raise HTTPError(400, "a malformed request") from None
        except httptools.HttpParserError as exc:
            if self.error is not None:
                raise self.error from None
            raise HTTPError(400, f"a malformed request: {str(exc)[:60]}") from None
        if self.error is not None:
            raise self.error

    # --- llhttp's callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            # Pipelined right behind a chunked body, in the same read: stop llhttp here, so
            # that this message's head is read from its first byte, with the checks above.
            self.overrun = True
            raise _Stop

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        text = value.rstrip(b" \t").decode("latin-1")
        if self.headers_done:  # a trailer: read and dropped
            self._trailer_bytes += len(name) + len(value) + 4
            if self._trailer_bytes > MAX_TRAILER_BYTES:
                self.error = HTTPError(431, "the chunked body's trailers are too long")
                raise _Stop
            return
        key = name.decode("latin-1").lower()
        headers = self._headers
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        self.headers_done = True
        try:
            self._framed()
        except HTTPError as exc:
            self.error = exc  # llhttp may find an error of its own next: ours is answered

    def _framed(self) -> None:
        parser = self._parser
        headers = self._headers
        http11 = parser.get_http_version() == "1.1"
        encoding = headers.get("transfer-encoding")
        if encoding is not None:
            if encoding.lower() != "chunked" or not http11:
                raise HTTPError(501, "only a chunked Transfer-Encoding is served")
            self.chunked = True
        elif "content-length" in headers:
            self.length = int(headers["content-length"])  # llhttp: digits, one value
            if self.length > self._max_body:
                raise too_large(self.length, self._max_body)
        connection = headers.get("connection", "").lower()
        self.keep_alive = "close" not in connection if http11 else "keep-alive" in connection
        expect = headers.get("expect")
        if expect is not None and expect.lower() != "100-continue":
            raise HTTPError(417, "only Expect: 100-continue is served")
        self.expect_continue = expect is not None and http11
        method = parser.get_method().decode("ascii")
        self.request = Request(self._connection, method, _path(self._url), http11, headers)

    def on_body(self, body: bytes) -> None:
        self.body_size += len(body)
        if self.body_size > self._max_body:
            self.error = too_large(self.body_size, self._max_body)
            raise _Stop
        if self.chunked:
            self._chunks += body
        else:
            self._pieces.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


def too_large(size: int, limit: int) -> HTTPError:
    return HTTPError(
        413,
        f"the body is over the size limit (config max_message_bytes): {size} > {limit} bytes",
    )
