"""The pod client for `http://` pods (UpstreamClient.post over llhttp) against real sockets
on 127.0.0.1: an aiohttp pod for the framings and keep-alive, and raw asyncio servers
writing the bytes a broken or hostile pod would."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError
from prefix_sidecar.upstream.lean_http import PodAnswer
from prefix_sidecar.upstream.pod_connection import MAX_HEAD, PodHTTPError
from tests.fake_pod import serving

RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def aiohttp_pod() -> AsyncIterator[tuple[str, list[object]]]:
    """A pod answering /whole (Content-Length), /chunked (SSE, chunked) and /closed (no
    length, connection closed); it lists the transport of every request it serves."""
    seen: list[object] = []

    async def whole(request: web.Request) -> web.StreamResponse:
        seen.append(request.transport)
        return web.Response(body=b"x" * 100_000 + await request.read())

    async def chunked(request: web.Request) -> web.StreamResponse:
        seen.append(request.transport)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for part in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
            await response.write(part)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/whole", whole)
    app.router.add_post("/chunked", chunked)
    async with serving(app) as base_url:
        yield base_url, seen


@contextlib.asynccontextmanager
async def raw_pod(handler: RawHandler) -> AsyncIterator[str]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await handler(reader, writer)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def read_all(answer: PodAnswer) -> bytes:
    parts = []
    while data := await answer.read():
        parts.append(data)
    return b"".join(parts)


async def request_head(reader: asyncio.StreamReader) -> int:
    """Read one request; its body's length."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    return length


def ok_once_per_connection(connections: list[None], read_next: bool) -> RawHandler:
    """A raw pod's handler: note the connection in `connections`, answer one request "ok",
    then (`read_next`) read the next request too, and close the connection."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(None)
        await request_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        if read_next:
            await request_head(reader)

    return handler


def writes_then_waits(answer: bytes, linger_s: float) -> RawHandler:
    """A raw pod's handler: read one request, write `answer`, then keep the connection open
    for `linger_s` (so what the client sees comes from the bytes, not from a close)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await request_head(reader)
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(linger_s)

    return handler


async def answered_ok(lean: UpstreamClient, pod: str, times: int, pause_s: float = 0.0) -> None:
    """`times` requests one after another, each answered "ok", read whole and closed."""
    for _ in range(times):
        answer = await lean.post(pod, "/v1/completions", b"{}", {}, timeout_s=5)
        assert await read_all(answer) == b"ok"
        answer.close()
        await asyncio.sleep(pause_s)


def client() -> UpstreamClient:
    return UpstreamClient(connect_timeout_s=2.0, per_backend_connections=8)


async def test_each_framing_is_read_whole_and_a_finished_connection_is_reused() -> None:
    lean = client()
    async with aiohttp_pod() as (pod, seen):
        answer = await lean.post(pod, "/whole", b"body", {"X-A": "1"}, timeout_s=5)
        assert answer.status == 200 and answer.headers["content-length"] == "100004"
        assert await read_all(answer) == b"x" * 100_000 + b"body"
        answer.close()
        answer = await lean.post(pod, "/chunked", b"{}", {}, timeout_s=5)
        assert answer.headers["content-type"] == "text/event-stream"
        assert await read_all(answer) == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        answer.close()
        assert seen[0] is seen[1], "the second request did not reuse the connection"
    await lean.close()


async def test_an_answer_left_unread_closes_its_connection() -> None:
    lean = client()
    async with aiohttp_pod() as (pod, seen):
        answer = await lean.post(pod, "/whole", b"y" * 900_000, {}, timeout_s=5)
        assert await answer.read()
        assert not answer.done
        answer.close()  # not read to its end: the connection is not reused
        again = await lean.post(pod, "/whole", b"", {}, timeout_s=5)
        await read_all(again)
        again.close()
        assert seen[0] is not seen[1]
    await lean.close()


async def test_an_answer_delimited_by_the_connections_end() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await request_head(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"a": 1}')

    lean = client()
    async with raw_pod(handler) as pod:
        answer = await lean.post(pod, "/v1/completions", b"{}", {}, timeout_s=5)
        assert await read_all(answer) == b'{"a": 1}'
        answer.close()
    await lean.close()


@pytest.mark.parametrize(
    ("read_next", "times", "pause_s"),
    [(False, 3, 0.05), (True, 2, 0.0)],
    ids=["closed-while-idle", "closed-before-the-answer"],
)
async def test_a_kept_alive_connection_the_pod_closed_is_replaced_without_an_error(
    read_next: bool, times: int, pause_s: float
) -> None:
    """The pod answers one request a connection, then closes it: while it is idle (as an
    idle timeout does), or after reading the next request, unanswered (which is sent again
    once, on a new connection). Every request is answered, each on its own connection."""
    connections: list[None] = []
    handler = ok_once_per_connection(connections, read_next=read_next)
    lean = client()
    async with raw_pod(handler) as pod:
        await answered_ok(lean, pod, times, pause_s=pause_s)
    assert len(connections) == times
    await lean.close()


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * (MAX_HEAD + 10) + b"\r\n\r\n", "over"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 000 Zero\r\nContent-Length: 0\r\n\r\n", "not a valid HTTP status"),
        (b"HTTP/1.1 600 Beyond\r\nContent-Length: 0\r\n\r\n", "not a valid HTTP status"),
        (b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n", "not an HTTP/1.1 answer"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nabc", "Transfer-Encoding"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", "Transfer-Encoding"),
        (b"HTTP/1.1 101 Switching\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n", "switched"),
        (b"HTTP/1.1 103 Early Hints\r\n\r\n" * 5, "interim"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * (MAX_HEAD // 6 + 1) + b"\r\n", "over"),
    ],
)
async def test_a_bad_head_is_an_error_and_bounded(answer: bytes, match: str) -> None:
    """llhttp's rules, and those kept on top of it: statuses 100-599, HTTP/1.0 and 1.1 only,
    chunked as the only Transfer-Encoding, no protocol switch, at most MAX_INTERIM 1xx,
    headers within MAX_HEAD however they are split. Each is a pod failure."""

    handler = writes_then_waits(answer, 1)
    lean = client()
    async with raw_pod(handler) as pod:
        with pytest.raises(UpstreamError, match=match) as caught:
            await lean.post(pod, "/v1/completions", b"{}", {}, timeout_s=5)
    assert caught.value.retryable and caught.value.connection_failure
    await lean.close()


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"zz\r\ndata\r\n", "malformed"),  # not a chunk size
        (b"5\r\ndata: 1\r\n", "malformed"),  # the chunk is longer than it said
        (b"10\r\nshort", "closed"),  # cut mid-chunk
    ],
)
async def test_broken_chunked_framing_is_an_error(body: bytes, match: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await request_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body)

    lean = client()
    async with raw_pod(handler) as pod:
        answer = await lean.post(pod, "/v1/completions", b"{}", {}, timeout_s=5)
        with pytest.raises(PodHTTPError, match=match):
            await read_all(answer)
        answer.close()
    await lean.close()


async def test_a_pod_that_never_answers_is_a_pod_failure_at_the_deadline() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await request_head(reader)
        await asyncio.sleep(5)

    lean = client()
    async with raw_pod(handler) as pod:
        with pytest.raises(UpstreamError, match="timeout expired before the answer"):
            await asyncio.wait_for(lean.post(pod, "/v1/completions", b"{}", {}, timeout_s=0.3), 3)
    await lean.close()


async def test_a_stalled_answer_ends_at_the_deadline() -> None:
    handler = writes_then_waits(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", 5)
    lean = client()
    async with raw_pod(handler) as pod:
        answer = await lean.post(pod, "/v1/completions", b"{}", {}, timeout_s=0.3)
        assert await answer.read() == b"abc"
        with pytest.raises(PodHTTPError, match="timeout"):
            await asyncio.wait_for(answer.read(), 3)
        answer.close()
    await lean.close()


async def test_a_refused_connection_is_a_connection_failure() -> None:
    lean = client()
    async with raw_pod(request_head) as pod:  # type: ignore[arg-type]
        pass  # closed: nothing listens there now
    with pytest.raises(UpstreamError) as caught:
        await lean.post(pod, "/v1/completions", b"{}", {}, timeout_s=5)
    assert caught.value.connection_failure
    await lean.close()


async def test_answers_open_to_one_pod_are_bounded() -> None:
    lean = UpstreamClient(connect_timeout_s=2.0, per_backend_connections=1)
    async with aiohttp_pod() as (pod, seen):
        first = await lean.post(pod, "/whole", b"", {}, timeout_s=5)
        second = asyncio.ensure_future(lean.post(pod, "/whole", b"", {}, timeout_s=5))
        await asyncio.sleep(0.2)
        assert not second.done() and len(seen) == 1  # waits for the first answer's close
        await read_all(first)
        first.close()
        answer = await asyncio.wait_for(second, 5)
        await read_all(answer)
        answer.close()
        assert seen[0] is seen[1]  # and took its connection
    await lean.close()


async def test_an_interim_1xx_is_skipped_for_the_answer_after_it() -> None:
    handler = writes_then_waits(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", 0.5
    )
    lean = client()
    async with raw_pod(handler) as pod:
        answer = await lean.post(pod, "/v1/completions", b"{}", {}, timeout_s=5)
        assert answer.status == 200 and await read_all(answer) == b"ok"
        answer.close()
    await lean.close()


async def test_a_header_latin1_cannot_hold_is_sent_replaced_not_raised() -> None:
    got: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        got.append(head)
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    lean = client()
    async with raw_pod(handler) as pod:
        headers = {"Authorization": "Bearer k\udcff\u4e2d"}
        answer = await lean.post(pod, "/v1/completions", b"{}", headers, timeout_s=5)
        assert answer.status == 401
        answer.close()
    assert b"Authorization: Bearer k??\r\n" in got[0]
    await lean.close()


async def test_trailers_are_bounded_like_headers() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await request_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n")
        for _ in range(MAX_HEAD // 1000 + 2):
            writer.write(b"X-T: " + b"t" * 1000 + b"\r\n")
            await writer.drain()
        await asyncio.sleep(1)

    lean = client()
    async with raw_pod(handler) as pod:
        answer = await lean.post(pod, "/v1/completions", b"{}", {}, timeout_s=5)
        with pytest.raises(PodHTTPError, match="over"):
            await read_all(answer)
        answer.close()
    await lean.close()


async def test_bytes_after_the_answer_close_the_connection_and_are_counted() -> None:
    """Bytes the pod sends past an answer, in the same read or later while the connection
    is idle, are never read as the next answer: the connection closes, counted once."""
    unasked: list[str] = []
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            await request_head(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await asyncio.sleep(0.1)  # the answer is read and closed before this comes
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nstolen")
            await writer.drain()

    lean = UpstreamClient(on_unasked=unasked.append)
    async with raw_pod(handler) as pod:
        await answered_ok(lean, pod, 3, pause_s=0.3)
    assert connections == 3 and unasked == [pod, pod]  # the last one is still idle
    await lean.close()


async def test_both_fronts_share_one_connection_budget_per_pod() -> None:
    """per_backend_connections holds across both fronts: a gRPC stream open to the pod
    (open) makes the HTTP front's request (post) wait until the stream is closed."""
    lean = UpstreamClient(connect_timeout_s=2.0, per_backend_connections=1)
    async with aiohttp_pod() as (pod, seen):
        stream = await lean.open(pod, "/chunked", b"{}", timeout_s=5, chat=False)
        waiting = asyncio.ensure_future(lean.post(pod, "/whole", b"", {}, timeout_s=5))
        await asyncio.sleep(0.2)
        assert not waiting.done() and len(seen) == 1
        stream.close()
        answer = await asyncio.wait_for(waiting, 5)
        await read_all(answer)
        answer.close()
        assert len(seen) == 2
    await lean.close()
