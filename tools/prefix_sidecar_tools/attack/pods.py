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

Every stream is bounded by `STREAM_LIMIT_S` and stops when the sidecar hangs up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys

from aiohttp import web

MODES = ("fast", "huge", "nonewline", "redirect", "wedge", "recorder")
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
    for mode in MODES:
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
