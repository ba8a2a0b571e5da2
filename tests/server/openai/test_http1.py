"""The OpenAI front's HTTP/1.1 server (prefix_sidecar.server.openai.http1) on a real 127.0.0.1
socket: real clients (aiohttp, curl) for what clients do, raw bytes for what only a broken or
hostile caller sends (malformed framing, slow heads and bodies, pipelining, half-read streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from prefix_sidecar.server.openai import http1, http1_connection, http1_reading
from prefix_sidecar.server.openai.http1 import HTTP1Server, Request, Response, StreamedResponse

LIMIT = 64 * 1024

Handler = Callable[[Request], Awaitable[Response | StreamedResponse]]


def _error_body(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "code": status}}).encode()


async def _echo(request: Request) -> Response:
    """The method, path, one header and the body's length and bytes, as JSON."""
    body = request.body
    answer = {
        "method": request.method,
        "path": request.path,
        "auth": request.headers.get("authorization"),
        "size": len(body),
        "body": body.decode("latin-1"),
    }
    return Response(200, json.dumps(answer).encode(), content_type="application/json")


@contextlib.asynccontextmanager
async def serving(handler: Handler = _echo) -> AsyncIterator[tuple[str, HTTP1Server]]:
    server = HTTP1Server(handler, max_body_bytes=LIMIT, error_body=_error_body)
    listener = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        listener.close()
        server.close_all()
        await listener.wait_closed()


async def _raw(url: str, data: bytes, *, read_s: float = 2.0) -> bytes:
    """Send `data` on a new connection and read until the server closes it (or `read_s`)."""
    host, port = url[len("http://") :].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        out = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(read_s):
                while chunk := await reader.read(65536):
                    out += chunk
        return out
    finally:
        writer.close()


def _statuses(out: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", out)]


# --- what clients do -------------------------------------------------------------------


async def test_keep_alive_and_a_chunked_body_from_aiohttp() -> None:
    async def parts() -> AsyncIterator[bytes]:
        for piece in (b"abc", b"", b"d" * 5000, b"efg"):
            yield piece

    async with serving() as (url, server), aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.post(url + "/v1/x?q=1", data=b"hello") as reply:
                assert reply.status == 200
                answer = await reply.json()
                assert (answer["method"], answer["path"], answer["size"]) == ("POST", "/v1/x", 5)
        assert len(server.connections) == 1  # one kept-alive connection served all three
        async with session.post(url + "/", data=parts()) as reply:
            assert reply.request_info.headers.get("Transfer-Encoding") == "chunked"
            assert (await reply.json())["size"] == 5006


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with serving() as (url, _):
        first = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
        second = b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        second += b"2;ext=1\r\nde\r\n0\r\nTrailer: t\r\n\r\n"
        third = b"GET /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        out = await _raw(url, first + second + third)
    assert _statuses(out) == [200, 200, 200]
    bodies = [json.loads(part.split(b"\r\n\r\n", 1)[1]) for part in out.split(b"HTTP/1.1 ")[1:]]
    assert [(b["path"], b["body"]) for b in bodies] == [("/a", "abc"), ("/b", "de"), ("/c", "")]


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
async def test_curl_expect_100_continue_and_http_1_0() -> None:
    async with serving() as (url, _):
        body = "x" * 40_000
        curl = await asyncio.create_subprocess_exec(
            *("curl", "-sS", "-H", "Expect: 100-continue", "--expect100-timeout", "10"),
            *("-d", body, url + "/big"),
            stdout=asyncio.subprocess.PIPE,
        )
        # curl waits for "100 Continue" (up to 10 s here) before it sends the body.
        out, _ = await asyncio.wait_for(curl.communicate(), 5)
        assert json.loads(out)["size"] == 40_000
        curl = await asyncio.create_subprocess_exec(
            *("curl", "-sS", "-i", "--http1.0", "-d", "old", url + "/old"),
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(curl.communicate(), 5)
        head, _, body_out = out.partition(b"\r\n\r\n")
        assert b"Connection: close" in head and json.loads(body_out)["body"] == "old"


async def test_a_stream_is_chunked_and_http_1_0_gets_it_until_the_close() -> None:
    async def stream(request: Request) -> StreamedResponse:
        answer = StreamedResponse(request, 200, [("Content-Type", "text/event-stream")])
        for i in range(3):
            await answer.write(b"data: %d\n\n" % i)
        await answer.end()
        return answer

    async def whole(request: Request) -> StreamedResponse:
        answer = StreamedResponse(request, 200, [("Content-Type", "application/json")])
        await answer.end(b"{}")  # nothing written before its end: sent whole
        return answer

    async with serving(stream) as (url, _):
        async with aiohttp.ClientSession() as session, session.get(url + "/s") as reply:
            assert reply.headers["Transfer-Encoding"] == "chunked"
            assert await reply.read() == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        out = await _raw(url, b"GET /s HTTP/1.0\r\n\r\n")
    async with (
        serving(whole) as (url, _),
        aiohttp.ClientSession() as session,
        session.get(url + "/w") as reply,
    ):
        assert reply.headers["Content-Length"] == "2" and await reply.read() == b"{}"
    head, _, body = out.partition(b"\r\n\r\n")
    assert b"chunked" not in head and b"Content-Length" not in head
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


# --- bounds -----------------------------------------------------------------------------


async def test_a_body_over_the_limit_is_a_413_the_client_can_read() -> None:
    async with serving() as (url, _), aiohttp.ClientSession() as session:
        # Declared: refused before the body is read, yet the client's whole send completes
        # (the server drops it) and the answer reaches it.
        async with session.post(url + "/", data=b"x" * (LIMIT + 1)) as reply:
            assert reply.status == 413
            assert "size limit" in (await reply.json())["error"]["message"]

        async def parts() -> AsyncIterator[bytes]:
            for _ in range(40):
                yield b"y" * 4096

        async with session.post(url + "/", data=parts()) as reply:  # chunked: counted
            assert reply.status == 413


async def test_oversized_heads_are_refused() -> None:
    async with serving() as (url, _):
        big = b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (http1.MAX_HEAD_BYTES + 10) + b"\r\n\r\n"
        many = b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(150)) + b"\r\n"
        for request in (big, many):
            assert _statuses(await _raw(url, request)) == [431]


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: -3\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length : 3\r\n\r\nabc", 400),
        (b"GET / HTTP/1.1\r\nX-A: b\r\n folded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX-A: b\x00c\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET  / HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nExpect: 200-ok\r\n\r\n", 417),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX\r\n", 400),
        # Rules llhttp does not enforce, kept from the hand-written parser (http1_request):
        (b"GET /  HTTP/1.1\r\n\r\n", 400),  # one space between the request line's parts
        (b"G" * 33 + b" / HTTP/1.1\r\n\r\n", 400),  # a method of at most 32 characters
        (b"GET /" + b"a" * 8192 + b" HTTP/1.1\r\n\r\n", 400),  # a target of at most 8,192
        (b"GET /caf\xe9 HTTP/1.1\r\n\r\n", 400),  # visible ASCII only
        (b"GET / HTTP/0.9\r\n\r\n", 505),  # llhttp reads 0.9 and 2.0 too
        (b"OPTIONS * HTTP/1.1\r\n\r\n", 400),  # a path or an absolute http(s) URL
        (b"CONNECT pod:443 HTTP/1.1\r\n\r\n", 400),
        (b"GET ftp://h/x HTTP/1.1\r\n\r\n", 400),
        (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501),
        (
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX: "
            + b"t" * 17000
            + b"\r\n\r\n",
            431,
        ),  # trailers of at most 16 KiB
        # Leniencies nginx and h11 reject (issue 27), as llhttp reads them:
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc", 400),
        ("POST / HTTP/1.1\r\nContent-Length: \u00b2\r\n\r\nx".encode(), 400),
        (b"POST / HTTP/1.1\r\nContent-Length: +3\r\n\r\nabc", 400),
        *(
            (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + size + b"\r\nabc\r\n", 400)
            for size in (b"0x3", b"+3", b"1_3", b" 3", b"3 ")
        ),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;a=b\nc\r\nabc\r\n", 400),
        (b"GET / HTTP/1.1\r\nX-A: b\x01c\r\n\r\n", 400),
        (b"GET / HTTP/1.1\nHost: x\n\n", 400),  # bare LF line ends
    ],
)
async def test_malformed_framing_is_refused_and_closed(request_bytes: bytes, status: int) -> None:
    async with serving() as (url, _):
        out = await _raw(url, request_bytes + b"GET /next HTTP/1.1\r\n\r\n")
    assert _statuses(out) == [status]  # and nothing after: the connection closed
    assert b"Connection: close" in out
    assert json.loads(out.partition(b"\r\n\r\n")[2])["error"]["code"] == status


async def test_header_lines_are_read_in_linear_time() -> None:
    """The hand-written parser's header regex backtracked exponentially on a value ending
    in a control character: these 24 bytes held the loop 0.8 s (doubling per byte). llhttp
    reads a line once; each is refused at once."""
    redos = b"X-A: " + b"a" * 16 + b"\x01\r\n"  # 24 bytes
    assert len(redos) == 24
    async with serving() as (url, _):
        for value in (
            redos,
            b"X-A: " + b"a" * 8000 + b"\x01\r\n",
            b"X-A: " + b"\t" * 8000 + b"\x7f\r\n",
        ):
            started = time.perf_counter()
            out = await _raw(url, b"GET / HTTP/1.1\r\n" + value + b"\r\n")
            assert _statuses(out) == [400]
            assert time.perf_counter() - started < 0.2
        # Values lose their blanks at both ends; a repeated header's values are joined.
        head = b"GET / HTTP/1.1\r\nAuthorization: \tb c\t \r\nauthorization: d\r\n\r\n"
        out = await _raw(url, head, read_s=0.5)
    assert json.loads(out.partition(b"\r\n\r\n")[2])["auth"] == "b c, d"


async def test_an_upgrade_is_not_taken_but_the_request_is_served() -> None:
    """curl --http2 on plain HTTP asks for h2c with its POST: llhttp would hand the body to
    the other protocol; the request is served as HTTP/1.1 and the connection then closes."""
    async with serving() as (url, _):
        request = (
            b"POST /up HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
            b"Content-Length: 3\r\n\r\nabcGET /next HTTP/1.1\r\n\r\n"
        )
        out = await _raw(url, request)
        chunked = b"POST / HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: h2c\r\n"
        refused = await _raw(url, chunked + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert _statuses(out) == [200] and b"Connection: close" in out
    assert json.loads(out.partition(b"\r\n\r\n")[2])["body"] == "abc"
    assert _statuses(refused) == [400]


async def test_a_request_pipelined_behind_a_chunked_body_in_one_read_is_read_whole() -> None:
    """llhttp reads a chunked body only up to each CRLFCRLF, where alone it can end: the next
    request's head is then read from its first byte, with every rule above."""
    async with serving() as (url, _):
        chunked = b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        body = b"4\r\n\r\n\r\n\r\n2\r\nde\r\n0\r\n\r\n"  # data holding a CRLFCRLF
        out = await _raw(url, chunked + body + b"GET /b HTTP/1.1\r\n\r\nGET  /c HTTP/1.1\r\n\r\n")
    assert _statuses(out) == [200, 200, 400]
    bodies = [part.split(b"\r\n\r\n", 1)[1] for part in out.split(b"HTTP/1.1 ")[1:3]]
    assert [json.loads(b)["body"] for b in bodies] == ["\r\n\r\nde", ""]


async def test_connections_over_the_cap_are_answered_503_and_closed() -> None:
    async with serving() as (url, server):
        server.max_connections = 2
        host, port = url[len("http://") :].split(":")
        held = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        await asyncio.sleep(0.05)
        out = await _raw(url, b"", read_s=2)
        assert _statuses(out) == [503] and b"Retry-After: 1" in out
        assert len(server.connections) == 2 and server.refused_connections == 1
        for _, writer in held:
            writer.close()


async def test_slow_heads_bodies_and_idle_connections_time_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http1_reading, "HEAD_TIMEOUT_S", 0.2)
    monkeypatch.setattr(http1_reading, "BODY_TIMEOUT_S", 0.2)
    monkeypatch.setattr(http1_connection, "IDLE_TIMEOUT_S", 0.2)
    async with serving() as (url, server):
        started = asyncio.get_running_loop().time()
        assert _statuses(await _raw(url, b"GET / HTTP/1.1\r\nX-Slow:", read_s=3)) == [408]
        partial = b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc"
        assert _statuses(await _raw(url, partial, read_s=3)) == [408]
        assert await _raw(url, b"", read_s=3) == b""  # idle: closed without a word
        assert asyncio.get_running_loop().time() - started < 2.5
        assert not server.connections


async def test_a_caller_leaving_cancels_the_handler_and_writes_wait_for_a_slow_reader() -> None:
    cancelled = asyncio.Event()
    written: list[int] = []

    async def flood(request: Request) -> StreamedResponse:
        answer = StreamedResponse(request, 200)
        try:
            for _ in range(10_000):
                await answer.write(b"z" * 16384)
                written.append(16384)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        await answer.end()
        return answer

    async with serving(flood) as (url, _):
        host, port = url[len("http://") :].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.5)
        # The caller reads nothing: the handler waits once the socket buffers are full.
        assert 0 < sum(written) < 32 * 2**20
        before = sum(written)
        await asyncio.sleep(0.2)
        assert sum(written) == before
        await reader.read(65536)
        writer.close()
        await asyncio.wait_for(cancelled.wait(), 5)


async def test_answers_while_draining_close_the_connection_and_unsafe_values_are_dropped() -> None:
    async def labelled(request: Request) -> Response:
        return Response(
            200,
            b"ok",
            [("X-Pod", "a\r\nSet-Cookie: evil"), ("X-Ctl", "a\x01evil"), ("Bad Name", "evil"),
             ("X-Fine", "yes")],
        )  # fmt: skip

    async with serving(labelled) as (url, server):
        out = await _raw(url, b"GET / HTTP/1.1\r\n\r\n", read_s=0.3)
        assert b"X-Fine: yes" in out and b"evil" not in out and b"Connection: close" not in out
        server.draining = True
        out = await _raw(url, b"GET / HTTP/1.1\r\n\r\n")
        assert b"Connection: close" in out and out.endswith(b"ok")
