"""The server-frame A/B behind the HTTP front (`bench hop --frame-ab`): one trivial handler
(read the whole body, answer one SSE event, streamed) behind the front's own server
(prefix_sidecar.server.openai.http1, asyncio.Protocol) and behind aiohttp's low-level server
(aiohttp.web.Server: no Application, router or middleware), each in its own process.

This is the comparison that chose the asyncio.Protocol frame over aiohttp's (issue 13): the
same handler, the same request, only the server under it differs, so what is left is what
each frame costs per request - reading the head and body, the task switch into the handler,
the answer's writes. `bench hop` interleaves both with its other modes, one call at a time.

`python -m prefix_sidecar_tools.bench.frame_ab http1|aiohttp` listens on 127.0.0.1 (a free
port) and prints `READY PORT`; `frame_server(kind)` runs it as a child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator

from prefix_sidecar_tools.bench.children import ready_child
from prefix_sidecar_tools.harness import stop_on_signals

EVENT = b'data: {"choices": [{"text": "x", "index": 0}]}\n\n'
MAX_BODY = 64 * 1024 * 1024


def _listener() -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    return listener


async def _serve_http1() -> None:
    from prefix_sidecar.server.openai.http1 import HTTP1Server, Request, StreamedResponse

    async def handle(request: Request) -> StreamedResponse:
        assert request.body  # read whole by the server before the handler runs
        answer = StreamedResponse(request, 200, [("Content-Type", "text/event-stream")])
        await answer.write(EVENT)
        await answer.end()
        return answer

    server = HTTP1Server(handle, max_body_bytes=MAX_BODY, error_body=lambda s, m: m.encode())
    listener = _listener()
    served = await asyncio.get_running_loop().create_server(server, sock=listener)
    print(f"READY {listener.getsockname()[1]}", flush=True)
    await stop_on_signals().wait()
    served.close()
    server.close_all()


async def _serve_aiohttp() -> None:
    from aiohttp import web

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        assert await request.read()
        answer = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        await answer.write(EVENT)
        await answer.write_eof()
        return answer

    server = web.Server(handle, access_log=None)
    listener = _listener()
    served = await asyncio.get_running_loop().create_server(server, sock=listener)
    print(f"READY {listener.getsockname()[1]}", flush=True)
    await stop_on_signals().wait()
    served.close()
    await server.shutdown(1.0)


@contextlib.asynccontextmanager
async def frame_server(kind: str) -> AsyncIterator[str]:
    """`async with frame_server("http1") as url:` the trivial handler behind that frame."""
    module = "prefix_sidecar_tools.bench.frame_ab"
    async with ready_child(module, kind, what=f"the {kind} frame server") as (_, words):
        yield f"http://127.0.0.1:{int(words[0])}"


if __name__ == "__main__":
    if sys.argv[1:] == ["http1"]:
        asyncio.run(_serve_http1())
    elif sys.argv[1:] == ["aiohttp"]:
        asyncio.run(_serve_aiohttp())
    else:
        print("usage: python -m prefix_sidecar_tools.bench.frame_ab http1|aiohttp", file=sys.stderr)
        sys.exit(2)
