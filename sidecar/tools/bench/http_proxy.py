"""A bare aiohttp reverse proxy: the floor any HTTP hop in front of a pod costs, for `bench hop`.

`python -m sidecar.tools.bench.http_proxy UPSTREAM_URL` listens on 127.0.0.1 (a free port),
prints `READY PORT` and forwards every POST to the same path on UPSTREAM_URL: the body as it
came, the answer's status and content type back, its body streamed in the reads the pod's
socket gives (no parsing, no routing, no logging). One upstream connection pool, kept alive,
as the sidecar keeps its own. `http_proxy(url)` runs it as a child process (harness.spawn).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from sidecar.tools.harness import python_command, spawn, terminate

PASSED_HEADERS = ("Content-Type", "Authorization")


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
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await session.close()


@contextlib.asynccontextmanager
async def http_proxy(upstream: str) -> AsyncIterator[str]:
    """`async with http_proxy(pod_url) as url:` a proxy process in front of the pod."""
    process = await spawn(
        python_command("-m", "sidecar.tools.bench.http_proxy", upstream),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 20)
        if not line.startswith(b"READY "):
            raise RuntimeError("the HTTP proxy did not start; its stderr says why")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        await terminate(process, 5)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("http://"):
        asyncio.run(_serve(sys.argv[1].rstrip("/")))
    else:
        print("usage: python -m sidecar.tools.bench.http_proxy http://HOST:PORT", file=sys.stderr)
        sys.exit(2)
