"""HTTP/1.1 request framing for the OpenAI front's server (server.openai.http1): the head
(request line and headers) and a chunked body, read strictly.

Everything here comes from a caller and is untrusted, so the reading is strict where
leniency lets two parsers disagree about where a request ends (request smuggling): a header
name must be a token right before its colon, no line may be folded, a value holds no
control character but tab, Content-Length is digits and one value, Transfer-Encoding may
only be `chunked` and never beside a Content-Length, and chunk sizes are bounded hex. Sizes
are bounded by the caller of these functions (the head) or here (a chunk-size line and the
trailers). Errors are HTTPError with the status to answer; their messages quote at most a
few characters of what the caller sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_HEADERS = 100
MAX_CHUNK_LINE = 4096  # a chunk-size line with its extensions
MAX_TRAILER_BYTES = 16 * 1024
QUOTE = 40  # the most of a caller's bytes an error message repeats

_METHOD = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}")
_TARGET = re.compile(rb"[\x21-\x7e]{1,8192}")
# One repetition after the colon, over one character class: the match is linear in the
# line (a nested `(?:[visible]+[ \t]*)*` backtracks exponentially on a value ending in a
# control character, 0.8 s for 24 bytes; `[ \t]*` before the value quadratically on a run of
# blanks). The value's blanks are stripped after the match.
_HEADER = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):([\t\x20-\x7e\x80-\xff]*)")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")


class HTTPError(Exception):
    """A request the server answers itself with `status` (the connection then closes)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class Head:
    method: str
    path: str  # without the query
    http11: bool
    headers: dict[str, str]  # names lowercased; a repeated header's values joined by ", "
    keep_alive: bool
    length: int | None  # Content-Length; None for chunked
    chunked: bool
    expect_continue: bool


def parse_head(head: bytes) -> Head:
    """The request line and headers of `head` (up to, without, its blank line)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _METHOD.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
        raise HTTPError(400, "a malformed request line")
    version = parts[2]
    if version == b"HTTP/1.1":
        http11 = True
    elif version == b"HTTP/1.0":
        http11 = False
    else:
        raise HTTPError(505, "only HTTP/1.1 and HTTP/1.0 are served")
    if len(lines) > MAX_HEADERS + 1:
        raise HTTPError(431, f"more than {MAX_HEADERS} header lines")
    headers: dict[str, str] = {}
    lengths: set[bytes] = set()
    for line in lines[1:]:
        found = _HEADER.fullmatch(line)
        if found is None:
            raise HTTPError(400, "a malformed header line")
        name = found[1].decode("ascii").lower()
        value = found[2].strip(b" \t")
        if name == "content-length":
            lengths.add(value)
        text = value.decode("latin-1")
        headers[name] = f"{headers[name]}, {text}" if name in headers else text
    return _framed(parts[0].decode("ascii"), parts[1], http11, headers, lengths)


def _framed(
    method: str, target: bytes, http11: bool, headers: dict[str, str], lengths: set[bytes]
) -> Head:
    length: int | None = 0
    chunked = False
    encoding = headers.get("transfer-encoding")
    if encoding is not None:
        if lengths:
            raise HTTPError(400, "both Transfer-Encoding and Content-Length")
        if encoding.lower() != "chunked" or not http11:
            raise HTTPError(501, "only a chunked Transfer-Encoding is served")
        length, chunked = None, True
    elif lengths:
        (value,) = lengths if len(lengths) == 1 else (b"x",)
        if not value.isdigit() or len(value) > 18:
            raise HTTPError(400, "a malformed Content-Length")
        length = int(value)
    connection = headers.get("connection", "").lower()
    keep_alive = "close" not in connection if http11 else "keep-alive" in connection
    expect = headers.get("expect")
    if expect is not None and expect.lower() != "100-continue":
        raise HTTPError(417, "only Expect: 100-continue is served")
    path = target.split(b"?", 1)[0]
    if not path.startswith(b"/"):
        # The absolute form (a proxy's): http://host/path; anything else is no path here.
        scheme, _, rest = path.partition(b"://")
        if scheme.lower() not in (b"http", b"https") or not rest:
            raise HTTPError(400, "a request target must be a path")
        path = b"/" + rest.partition(b"/")[2]
    return Head(
        method,
        path.decode("ascii"),
        http11,
        headers,
        keep_alive,
        length,
        chunked,
        expect is not None and http11,
    )


class ChunkedBody:
    """A chunked body read as it arrives: `feed` bytes, get the body's bytes back and, once
    the last chunk and trailers are in, `done` and what came after them (`rest`)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._left = 0  # bytes of the current chunk's data still to come
        self._crlf = False  # the current chunk's data is in; its CRLF is next
        self._trailers = False  # the last chunk came: the trailers are next
        self.done = False
        self.rest = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += data
        out: list[bytes] = []
        at = 0
        while not self.done:
            if self._left:
                take = min(self._left, len(buffer) - at)
                if not take:
                    break
                out.append(bytes(buffer[at : at + take]))
                at += take
                self._left -= take
                self._crlf = not self._left
            elif self._crlf:
                if len(buffer) - at < 2:
                    break
                if buffer[at : at + 2] != b"\r\n":
                    raise HTTPError(400, "a chunk without its CRLF")
                at += 2
                self._crlf = False
            elif self._trailers:
                # After the last chunk: trailer lines (ignored), then a blank line.
                if len(buffer) - at < 2:
                    break
                end = at - 2 if buffer[at : at + 2] == b"\r\n" else buffer.find(b"\r\n\r\n", at)
                if end < 0:
                    if len(buffer) - at > MAX_TRAILER_BYTES:
                        raise HTTPError(431, "the chunked body's trailers are too long")
                    break
                self.done = True
                self.rest = bytes(buffer[end + 4 :])
                at = len(buffer)
            else:
                end = buffer.find(b"\r\n", at, at + MAX_CHUNK_LINE + 2)
                if end < 0:
                    if len(buffer) - at > MAX_CHUNK_LINE:
                        raise HTTPError(400, "a chunk-size line is too long")
                    break
                size = bytes(buffer[at:end]).split(b";", 1)[0].rstrip(b" \t")
                if not _HEX.fullmatch(size):
                    raise HTTPError(400, "a malformed chunk size")
                at = end + 2
                self._left = int(size, 16)
                self._trailers = not self._left
        del buffer[:at]
        return out
