"""Bare reverse proxies: the floor any HTTP hop in front of a pod costs, for `bench hop`.

`python -m prefix_sidecar_tools.bench.http_proxy UPSTREAM_URL` listens on 127.0.0.1 (a free port),
prints `READY PORT` and forwards every POST to the same path on UPSTREAM_URL: the body as it
came, the answer's status and content type back, its body streamed in the reads the pod's
socket gives (no parsing, no routing, no logging). One upstream connection pool, kept alive,
as the sidecar keeps its own. `http_proxy(url)` runs it as a child process (harness.spawn).

`--raw` is the floor under that: asyncio streams and HTTP/1.1 by hand (a Content-Length
request in, the pod's answer relayed as framed, one kept-alive pod connection reused), no
aiohttp at all. It serves only what `bench hop` sends; it is a measurement, not a proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from prefix_sidecar_tools.bench.children import ready_child
from prefix_sidecar_tools.harness import stop_on_signals

PASSED_HEADERS = ("Content-Type", "Authorization")


async def _serve_raw(upstream: str) -> None:
    host, port = upstream[len("http://") :].rsplit(":", 1)
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                length = int(_header(head, b"content-length") or b"0")
                body = await reader.readexactly(length)
                pod = idle.pop() if idle else await asyncio.open_connection(host, int(port))
                pod[1].write(
                    b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (path, host.encode(), length, body)
                )
                answer = await pod[0].readuntil(b"\r\n\r\n")
                writer.write(answer)
                if _header(answer, b"transfer-encoding") == b"chunked":
                    while True:
                        size_line = await pod[0].readuntil(b"\r\n")
                        size = int(size_line.split(b";")[0], 16)
                        writer.write(size_line + await pod[0].readexactly(size + 2))
                        if size == 0:
                            break
                else:
                    length = int(_header(answer, b"content-length") or 0)
                    writer.write(await pod[0].readexactly(length))
                idle.append(pod)

    server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=2**20)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    await stop_on_signals().wait()
    server.close()


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


async def _serve(upstream: str) -> None:
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=512), timeout=aiohttp.ClientTimeout(total=None)
    )

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: request.headers[k] for k in PASSED_HEADERS if k in request.headers}
        async with session.post(f"{upstream}{request.path}", data=body, headers=headers) as answer:
            response = web.StreamResponse(status=answer.status)
            response.content_type = answer.content_type
            await response.prepare(request)
            async for data in answer.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/{path:.*}", forward)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, listener)
    await site.start()
    print(f"READY {listener.getsockname()[1]}", flush=True)
    try:
        await stop_on_signals().wait()
    finally:
        await runner.cleanup()
        await session.close()


@contextlib.asynccontextmanager
async def http_proxy(upstream: str, *, raw: bool = False) -> AsyncIterator[str]:
    """`async with http_proxy(pod_url) as url:` a proxy process in front of the pod (`raw`:
    the hand-written one)."""
    flags = ("--raw",) if raw else ()
    module = "prefix_sidecar_tools.bench.http_proxy"
    async with ready_child(module, *flags, upstream, what="the HTTP proxy") as (_, words):
        yield f"http://127.0.0.1:{int(words[0])}"


if __name__ == "__main__":
    arguments = sys.argv[1:]
    raw = arguments[:1] == ["--raw"]
    if raw:
        arguments = arguments[1:]
    if len(arguments) == 1 and arguments[0].startswith("http://"):
        asyncio.run((_serve_raw if raw else _serve)(arguments[0].rstrip("/")))
    else:
        print(
            "usage: python -m prefix_sidecar_tools.bench.http_proxy [--raw] http://HOST:PORT",
            file=sys.stderr,
        )
        sys.exit(2)
