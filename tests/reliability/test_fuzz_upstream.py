"""Upstream garbage: a pod that answers with something that is not a valid OpenAI SSE stream.

Before the first token the request moves to the next pod (with one pod: UNAVAILABLE naming
the reason); after it the stream ends UNAVAILABLE saying the text is partial. Either way the
sidecar keeps serving: the same pod, behaving again, serves the next request. The pods are
tiny aiohttp servers on 127.0.0.1 (conftest `fake_pod`), plus the emulator for its
malformed-SSE fault.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator, set_faults
from tests.fake_pod import REQUEST, Handler, StartPod, complete, event, respond, text_event

StartSidecar = Callable[..., contextlib.AbstractAsyncContextManager[Any]]


async def huge_event(request: web.Request) -> web.StreamResponse:
    """An event that never ends: 'data: xxxx...' without a blank line, up to 24 MiB."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    block = b"x" * 65536
    try:
        await response.write(b"data: ")
        for _ in range(24 * 16):
            await response.write(block)
    except (ConnectionResetError, RuntimeError):
        pass  # the sidecar gave up reading: what we want
    return response


async def html_400(request: web.Request) -> web.Response:
    return web.Response(status=400, text="<html>" + "y" * 100_000, content_type="text/html")


# name -> (handler, status, words the message must contain). Nothing reached the caller.
BEFORE_FIRST_TOKEN: dict[str, tuple[Handler, str, str]] = {
    "html_body": (
        respond(b"<html><body>It works!</body></html>", content_type="text/html"),
        "UNAVAILABLE",
        "closed the stream before [DONE]",
    ),
    "json_instead_of_sse": (
        respond(b'{"choices": [{"text": "hi"}]}', content_type="application/json"),
        "UNAVAILABLE",
        "closed the stream before [DONE]",
    ),
    "empty_body": (respond(), "UNAVAILABLE", "closed the stream before [DONE]"),
    "invalid_json": (respond(b"data: {not json\n\n"), "UNAVAILABLE", "malformed JSON"),
    "json_not_object": (respond(event([1, 2])), "UNAVAILABLE", "not a JSON object"),
    "choice_not_object": (respond(event({"choices": [7]})), "UNAVAILABLE", "not a JSON object"),
    "invalid_utf8": (
        respond(b'data: {"choices": [{"text": "\xff\xfe"}]}\n\n'),
        "UNAVAILABLE",
        "malformed JSON",
    ),
    "error_event": (
        respond(event({"error": {"message": "engine overloaded"}})),
        "UNAVAILABLE",
        "engine overloaded",
    ),
    "truncated_chunked_body": (
        respond(b'data: {"choices": [{"te', cut=True),
        "UNAVAILABLE",
        "stream broke",
    ),
    "huge_event_without_newline": (huge_event, "UNAVAILABLE", "larger than"),
    "html_400": (html_400, "INVALID_ARGUMENT", "HTTP 400"),
}


async def assert_still_serving(sidecar: Any, stub: Any, pod: Any) -> None:
    pod.behave()
    chunks, status, message = await complete(stub, timeout=20)
    assert status == "OK", message
    assert "".join(c.text for c in chunks) == "hello" and chunks[0].backend == pod.url
    async with grpc.aio.insecure_channel(sidecar.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="sidecar.v1.Router"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("name", BEFORE_FIRST_TOKEN)
async def test_garbage_before_first_token_one_pod(
    name: str, fake_pod: StartPod, start_sidecar: StartSidecar
) -> None:
    handler, expected, words = BEFORE_FIRST_TOKEN[name]
    pod = await fake_pod(handler)
    async with start_sidecar([pod.url]) as (sidecar, stub):
        chunks, status, message = await complete(stub, timeout=20)
        assert (status, chunks) == (expected, []), message
        assert words in message and pod.url in message, message
        assert len(message) < 2000, "a pod's huge error body must not be relayed whole"
        await assert_still_serving(sidecar, stub, pod)


@pytest.mark.parametrize(
    "name", [n for n, v in BEFORE_FIRST_TOKEN.items() if v[1] != "INVALID_ARGUMENT"]
)
async def test_garbage_before_first_token_fails_over(
    name: str, fake_pod: StartPod, start_sidecar: StartSidecar
) -> None:
    """The home pod sends garbage, the next one is fine: the caller sees only success."""
    first, second = await fake_pod(), await fake_pod()
    async with start_sidecar([first.url, second.url]) as (_, stub):
        route = await stub.Route(router_pb2.RouteRequest(prompt=REQUEST.input))
        bad, good = (first, second) if route.backend == first.url else (second, first)
        bad.handler = BEFORE_FIRST_TOKEN[name][0]
        chunks, status, message = await complete(stub, timeout=20)
        assert status == "OK", message
        assert chunks[0].backend == good.url and chunks[0].attempts == 2
        assert len(bad.bodies) == 1 and len(good.bodies) == 1


async def test_chat_garbage_is_unavailable_then_serves(
    fake_pod: StartPod, start_sidecar: StartSidecar
) -> None:
    pod = await fake_pod(respond(b"data: {broken\n\n"))
    chat = router_pb2.ChatRequest(messages=[router_pb2.ChatMessage(role="user", content="hi")])
    async with start_sidecar([pod.url]) as (_, stub):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [c async for c in stub.Chat(chat, timeout=20)]
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "malformed JSON" in (info.value.details() or "")
        pod.behave()
        chunks = [c async for c in stub.Chat(chat, timeout=20)]
        assert "".join(c.text for c in chunks) == "hello"


@pytest.mark.parametrize(
    "handler",
    [
        respond(text_event("partial "), cut=True, pause=0.2),
        respond(text_event("partial "), b"data: {oops\n\n", pause=0.2),
        respond(text_event("partial "), event({"error": "gpu fell off"}), pause=0.2),
    ],
    ids=["truncated_body", "invalid_json", "error_event"],
)
async def test_garbage_after_first_token_is_partial(
    handler: Handler, fake_pod: StartPod, start_sidecar: StartSidecar
) -> None:
    pod = await fake_pod(handler)
    async with start_sidecar([pod.url]) as (sidecar, stub):
        chunks, status, message = await complete(stub, timeout=20)
        assert status == "UNAVAILABLE" and "partial" in message, message
        assert [c.text for c in chunks] == ["partial "]
        assert len(pod.bodies) == 1, "a stream cut after the first token must not be replayed"
        await assert_still_serving(sidecar, stub, pod)


async def test_garbage_usage_and_lone_surrogates_are_tolerated(
    fake_pod: StartPod, start_sidecar: StartSidecar
) -> None:
    """Text is what the caller wants; bad token counts read as 0 and a lone surrogate (legal
    in JSON, impossible in protobuf) becomes U+FFFD, instead of failing the stream."""
    usage = {
        "prompt_tokens": "lots",
        "completion_tokens": -5,
        "prompt_tokens_details": {"cached_tokens": 1e99},
    }
    pod = await fake_pod(
        respond(
            text_event("fine "),
            b'data: {"choices": [{"text": "\\ud800!", "finish_reason": "stop"}]}\n\n',
            event({"choices": [], "usage": usage}),
            b"data: [DONE]\n\n",
            pause=0.05,
        )
    )
    async with start_sidecar([pod.url]) as (_, stub):
        chunks, status, message = await complete(stub, timeout=20)
        assert status == "OK", message
        assert "".join(c.text for c in chunks) == "fine \ufffd!"
        last = chunks[-1].usage
        assert (last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (0, 0, 0)


async def test_emulator_malformed_sse_fault(start_sidecar: StartSidecar) -> None:
    """The emulator's own fault switch: event K+1 is JSON cut in half."""
    config = EmulatorConfig(time_scale=1.0, decode_tps=50.0)
    async with (
        run_emulator(config) as url,
        start_sidecar([url]) as (_, stub),
    ):
        request = router_pb2.CompleteRequest(input="hello", max_tokens=6)
        await set_faults(url, malformed_after_chunks=0)
        chunks, status, message = await complete(stub, request, timeout=20)
        assert (status, chunks) == ("UNAVAILABLE", []) and "malformed JSON" in message
        await set_faults(url, malformed_after_chunks=2)
        chunks, status, message = await complete(stub, request, timeout=20)
        assert status == "UNAVAILABLE" and "partial" in message, message
        assert chunks and chunks[0].backend == url
        await set_faults(url, malformed_after_chunks=None)
        chunks, status, message = await complete(stub, request, timeout=20)
        assert status == "OK" and chunks[-1].usage.completion_tokens == 6, message
