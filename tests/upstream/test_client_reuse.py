"""UpstreamClient keeps a finished stream's connection for the next request (no TCP connect
per request) and drops one whose stream did not end cleanly, against a real aiohttp server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from prefix_sidecar.upstream import client as client_module
from prefix_sidecar.upstream.client import UpstreamClient
from tests.fake_pod import start_site

EVENT = b"data: " + json.dumps({"choices": [{"text": "hi", "finish_reason": "stop"}]}).encode()


class Pod:
    """Streams one event and [DONE], then ends the body after `tail_delay_s`."""

    def __init__(self) -> None:
        self.connections = 0
        self.tail_delay_s = 0.0
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(EVENT + b"\n\ndata: [DONE]\n\n")
        if self.tail_delay_s:
            await asyncio.sleep(self.tail_delay_s)
        await response.write_eof()
        return response


@pytest.fixture
async def pod() -> AsyncIterator[Pod]:
    state = Pod()

    app = web.Application()
    app.router.add_post("/v1/completions", state.handle)
    runner, state.url = await start_site(app, access_log=None)

    original = runner.server.connection_made  # type: ignore[union-attr]

    def connection_made(*args: object) -> None:
        state.connections += 1
        original(*args)  # type: ignore[arg-type]

    runner.server.connection_made = connection_made  # type: ignore[union-attr,method-assign]
    try:
        yield state
    finally:
        await runner.cleanup()


async def _one_stream(client: UpstreamClient, url: str) -> None:
    stream = await client.open(url, "/v1/completions", b"{}", timeout_s=5.0, chat=False)
    try:
        delta = await stream.next_delta()
        while not stream.finished:
            delta.merge(await stream.next_delta())
        assert delta.text == "hi" and delta.done
    finally:
        stream.close()


async def test_finished_streams_reuse_one_connection_even_when_the_body_ends_late(
    pod: Pod,
) -> None:
    pod.tail_delay_s = 0.05  # [DONE] arrives well before the chunked terminator
    client = UpstreamClient()
    try:
        for _ in range(3):
            await _one_stream(client, pod.url)
            await asyncio.sleep(0.1)  # the background drain sees the end of the body
        assert pod.connections == 1
    finally:
        await client.close()


async def test_a_body_that_does_not_end_loses_its_connection(
    pod: Pod, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "DRAIN_TIMEOUT_S", 0.05)
    pod.tail_delay_s = 0.5
    client = UpstreamClient()
    try:
        await _one_stream(client, pod.url)
        await asyncio.sleep(0.15)  # the drain gave up and closed the connection
        pod.tail_delay_s = 0.0
        await _one_stream(client, pod.url)
        assert pod.connections == 2
    finally:
        await client.close()


async def test_close_cancels_a_pending_drain(pod: Pod) -> None:
    pod.tail_delay_s = 2.0
    client = UpstreamClient()
    await _one_stream(client, pod.url)
    started = asyncio.get_running_loop().time()
    await client.close()
    assert asyncio.get_running_loop().time() - started < 1.0
