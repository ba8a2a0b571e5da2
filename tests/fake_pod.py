"""A pod the test writes itself: an aiohttp server on 127.0.0.1 that speaks just enough of
vLLM (`/health` answers 200; the two inference paths run a handler the test can swap) and
records when each request came, its headers and its body, so a test can say what reached
the pod.

One pod for every test that needs a pod to answer one way or to tell what it was sent; the
handlers below are the answers they share: a good stream, parts written as given (cut,
paused or of another content type), and the SSE framing of events. `complete` is the other
end: what a gRPC caller of the sidecar saw of that answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from multidict import CIMultiDict

from prefix_sidecar.v1 import router_pb2

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
DONE = b"data: [DONE]\n\n"


async def start_site(
    app: web.Application, tls: ssl.SSLContext | None = None, **runner_options: Any
) -> tuple[web.AppRunner, str]:
    """Serve `app` on a free port of 127.0.0.1, over TLS with `tls`: its runner (the caller
    cleans it up) and its base URL."""
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
    except BaseException:
        await runner.cleanup()
        raise
    scheme = "https" if tls else "http"
    return runner, f"{scheme}://127.0.0.1:{runner.addresses[0][1]}"


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """`app` on a free port of 127.0.0.1 for the block: its base URL."""
    runner, url = await start_site(app)
    try:
        yield url
    finally:
        await runner.cleanup()


def event(payload: Any) -> bytes:
    """One SSE event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def text_event(text: str, finish: str | None = None) -> bytes:
    """A completions event of one choice: `text`, and `finish` as its finish_reason."""
    return event({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def sse(*json_texts: str) -> bytes:
    """SSE events of these JSON texts, byte for byte, then [DONE]."""
    return b"".join(b"data: " + text.encode() + b"\n\n" for text in json_texts) + DONE


def sse_ok(text: str = "hello", chat: bool = False) -> bytes:
    """A well-formed one-token stream with usage."""
    piece = {"delta": {"content": text}} if chat else {"text": text}
    events = [
        {"choices": [{"index": 0, **piece, "finish_reason": None}]},
        {"choices": [{"index": 0, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
    ]
    return b"".join(map(event, events)) + DONE


def respond(
    *parts: bytes,
    content_type: str = "text/event-stream",
    cut: bool = False,
    pause: float = 0.0,
    stall_s: float = 0.0,
    cut_after_s: float = 0.0,
) -> Handler:
    """A handler writing `parts` as a chunked 200 response after `stall_s`, `pause` s apart
    (so the sidecar relays each before the next); `cut` drops the connection instead of
    ending the body, `cut_after_s` after the last part."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if stall_s:
            await asyncio.sleep(stall_s)
        response = web.StreamResponse(headers={"Content-Type": content_type})
        await response.prepare(request)
        for index, part in enumerate(parts):
            if index and pause:
                await asyncio.sleep(pause)
            await response.write(part)
        if cut:
            if cut_after_s:
                await asyncio.sleep(cut_after_s)
            assert request.transport is not None
            request.transport.abort()
        else:
            await response.write_eof()
        return response

    return handle


def answer_with(text: str) -> Handler:
    """A well-behaved pod's answer, one token `text`, in the format of the path asked."""

    async def handle(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        return await respond(sse_ok(text, chat=chat))(request)

    return handle


ok_stream = answer_with("hello")


@dataclass
class FakePod:
    """The running pod: its URL, the handler its inference paths run (swap it to change
    behaviour), and each request's arrival (time.monotonic()), headers (case-insensitive,
    as HTTP has them) and body."""

    url: str
    handler: Handler = ok_stream
    arrived: list[float] = field(default_factory=list)
    headers: list[CIMultiDict[str]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)

    def behave(self) -> None:
        """From now on answer like a healthy pod."""
        self.handler = ok_stream


@contextlib.asynccontextmanager
async def recording_pod(
    handler: Handler = ok_stream, tls: ssl.SSLContext | None = None
) -> AsyncIterator[FakePod]:
    """Serve a FakePod on a free port of 127.0.0.1 (over TLS with `tls`) until the block
    ends."""
    pod = FakePod(url="", handler=handler)

    async def inference(request: web.Request) -> web.StreamResponse:
        pod.arrived.append(time.monotonic())
        pod.headers.append(CIMultiDict(request.headers))
        pod.bodies.append(await request.read())
        return await pod.handler(request)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", inference)
    app.router.add_post("/v1/chat/completions", inference)
    runner, pod.url = await start_site(app, tls, access_log=None, shutdown_timeout=0.5)
    try:
        yield pod
    finally:
        await asyncio.wait_for(runner.cleanup(), 5)


StartPod = Callable[..., Awaitable[FakePod]]  # the reliability tests' `fake_pod` fixture
REQUEST = router_pb2.CompleteRequest(input="hello there", max_tokens=4)


async def complete(
    stub: Any, request: Any = REQUEST, timeout: float = 30.0
) -> tuple[list[Any], str, str]:
    """What a caller of Complete saw of the pod's answer: (chunks received, status name,
    message)."""
    chunks: list[Any] = []
    try:
        async for chunk in stub.Complete(request, timeout=timeout):
            chunks.append(chunk)
    except grpc.aio.AioRpcError as exc:
        return chunks, exc.code().name, exc.details() or ""
    return chunks, "OK", ""
