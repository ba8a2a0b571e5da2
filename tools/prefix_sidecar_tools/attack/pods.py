"""Misbehaving vLLM pods on 127.0.0.1: one small aiohttp app per misbehaviour.

`python -m prefix_sidecar_tools.attack.pods [--huge-bytes N]` serves every mode on its own port and
prints one `READY MODE URL` line per mode, then serves until stdin closes (so it never outlives the
`prefix-sidecar attack` run that started it). Each mode answers `/health` 200, like a pod
that looks fine:

- fast: completions stream tiny SSE events as fast as the socket takes them;
- huge: one event larger than the sidecar's gRPC message limit, then [DONE];
- nonewline: `data: ` and then bytes without a newline, forever;
- redirect: 307 to the `recorder` server, which counts every request that reaches it;
- wedge: completions are accepted and never answered.

And pods that break HTTP itself, written byte by byte on keep-alive connections (RAW_MODES,
issue 27): each answers a completion whose text is the request's `prompt`, framed wrongly:

- unasked: a right answer, then a second one nobody asked for on the same connection;
- bad_length: `Content-Length: ²` (the latin-1 byte); length_twice: two Content-Lengths
  (the last the right one); length_and_chunked: a Content-Length beside
  `Transfer-Encoding: chunked`;
- status_99, status_0, status_600: statuses that are not HTTP statuses;
- interim_5: five `100 Continue` before the answer; interim_http10: an `HTTP/1.0 100`;
- no_content_body: a 204 with a body;
- chunk_0x, chunk_underscore, chunk_plus, chunk_blank: chunk sizes `0x1f`, `1_f`, `+1f`,
  ` 1f `; extension_lf: a bare LF inside a chunk extension;
- header_ctl: a control character in the Content-Type's value.

A sidecar must fail each over to a good pod, and never hand one caller another's answer.
`good` frames the same answers right.

Every stream is bounded by `STREAM_LIMIT_S` and stops when the sidecar hangs up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable

from aiohttp import web

MODES = ("fast", "huge", "nonewline", "redirect", "wedge", "recorder")
UNASKED_TEXT = "an answer nobody asked for"
STREAM_LIMIT_S = 120.0
CHUNK = 64 * 1024


def _event(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


async def _health(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    return response


def make_app(mode: str, huge_bytes: int, recorder_url: str, hits: list[int]) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        loop = asyncio.get_running_loop()
        end = loop.time() + STREAM_LIMIT_S
        if mode == "recorder":
            hits[0] += 1
            response = await _sse(request)
            await response.write(_event("recorded", "stop") + b"data: [DONE]\n\n")
            return response
        if mode == "redirect":
            raise web.HTTPTemporaryRedirect(recorder_url + request.path)
        if mode == "wedge":
            await asyncio.sleep(STREAM_LIMIT_S)
            raise web.HTTPServiceUnavailable()
        response = await _sse(request)
        with contextlib.suppress(ConnectionError):  # the sidecar hung up: expected
            await _misbehave(response, mode, huge_bytes, end)
        return response

    async def hit_count(_request: web.Request) -> web.Response:
        return web.json_response({"hits": hits[0]})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", _health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/hits", hit_count)
    return app


async def _misbehave(response: web.StreamResponse, mode: str, huge_bytes: int, end: float) -> None:
    loop = asyncio.get_running_loop()
    if mode == "huge":
        await response.write(_event("x" * huge_bytes))
        await response.write(_event("", "stop") + b"data: [DONE]\n\n")
    elif mode == "nonewline":
        await response.write(b"data: ")
        block = b"a" * CHUNK
        while loop.time() < end:
            await response.write(block)
    else:  # fast: many tiny events per write, flat out
        burst = _event("a") * 256
        while loop.time() < end:
            await response.write(burst)


def _completion(text: str, stream: bool) -> tuple[bytes, bytes]:
    """A completion of `text`, whole or as vLLM's SSE stream; (body, its Content-Type)."""
    choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    answer = {"id": "cmpl-raw", "object": "text_completion", "created": 1, "model": "m"}
    body = json.dumps({**answer, "choices": [choice], "usage": usage}).encode()
    if stream:
        return b"data: " + body + b"\n\ndata: [DONE]\n\n", b"text/event-stream"
    return body, b"application/json"


Answer = tuple[bytes, bytes]  # a body and its Content-Type


def _whole(answer: Answer, status: bytes = b"200 OK", length: bytes | None = None) -> bytes:
    body, kind = answer
    length = b"%d" % len(body) if length is None else length
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: " + kind + b"\r\n"
        b"Content-Length: " + length + b"\r\n\r\n" + body
    )


def _chunked(answer: Answer, size_line: bytes, extra_head: bytes = b"") -> bytes:
    body, kind = answer
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\n" + extra_head
        + b"Transfer-Encoding: chunked\r\n\r\n" + size_line + b"\r\n" + body
        + b"\r\n0\r\n\r\n"
    )  # fmt: skip


def _hex(answer: Answer) -> bytes:
    return b"%x" % len(answer[0])


def _unasked(answer: Answer) -> bytes:
    return _whole(answer) + _whole(_completion(UNASKED_TEXT, answer[1] == b"text/event-stream"))


# What each raw pod writes for a completion (`good` frames it right).
RAW_MODES: dict[str, Callable[[Answer], bytes]] = {
    "good": _whole,
    "unasked": _unasked,
    "bad_length": lambda a: _whole(a, length=b"\xb2"),  # "²" in latin-1: "isdigit()"
    "length_twice": lambda a: _whole(a, length=b"1\r\nContent-Length: %d" % len(a[0])),
    "length_and_chunked": lambda a: _chunked(a, _hex(a), b"Content-Length: 5\r\n"),
    "status_99": lambda a: _whole(a, b"099 Unknown"),
    "status_0": lambda a: _whole(a, b"000 Zero"),
    "status_600": lambda a: _whole(a, b"600 Beyond"),
    "interim_5": lambda a: b"HTTP/1.1 100 Continue\r\n\r\n" * 5 + _whole(a),
    "interim_http10": lambda a: b"HTTP/1.0 100 Continue\r\n\r\n" + _whole(a),
    "no_content_body": lambda a: _whole(a, b"204 No Content"),
    "chunk_0x": lambda a: _chunked(a, b"0x" + _hex(a)),
    "chunk_underscore": lambda a: _chunked(a, _hex(a)[:1] + b"_" + _hex(a)[1:]),
    "chunk_plus": lambda a: _chunked(a, b"+" + _hex(a)),
    "chunk_blank": lambda a: _chunked(a, b" " + _hex(a) + b" "),
    "extension_lf": lambda a: _chunked(a, _hex(a) + b";a\nb"),
    "header_ctl": lambda a: _chunked(a, _hex(a), b"Cache-Control: no\x01cache\r\n"),
}


async def _raw_connection(
    mode: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Answer every request on one connection: GETs (health checks) with a plain 200, POSTs
    with the mode's answer to their prompt."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ValueError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length)
            if head.startswith(b"GET "):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                continue
            try:
                request = json.loads(body)
                prompt, stream = str(request.get("prompt", "")), bool(request.get("stream"))
            except (ValueError, AttributeError):
                prompt, stream = "", False
            writer.write(RAW_MODES[mode](_completion(prompt, stream)))
            await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def raw_pod(mode: str) -> AsyncIterator[str]:
    """A RAW_MODES pod on 127.0.0.1 while the context is open; yields its URL."""
    server = await asyncio.start_server(
        lambda reader, writer: _raw_connection(mode, reader, writer), "127.0.0.1", 0
    )
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def serve(huge_bytes: int) -> None:
    hits = [0]
    runners: list[web.AppRunner] = []
    urls: dict[str, str] = {}
    # The recorder first: the redirect pod points at it.
    for mode in ("recorder", *[m for m in MODES if m != "recorder"]):
        app = make_app(mode, huge_bytes, urls.get("recorder", ""), hits)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        urls[mode] = f"http://127.0.0.1:{port}"
        runners.append(runner)
    async with contextlib.AsyncExitStack() as stack:
        for mode in RAW_MODES:
            urls[mode] = await stack.enter_async_context(raw_pod(mode))
        for mode in (*MODES, *RAW_MODES):
            print(f"READY {mode} {urls[mode]}", flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    for runner in runners:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--huge-bytes", type=int, default=2 * 1024 * 1024)
    asyncio.run(serve(parser.parse_args().huge_bytes))


if __name__ == "__main__":
    main()
