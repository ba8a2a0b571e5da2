"""The upstream client asks every pod for its load report and hands the answer over, against
real pods on 127.0.0.1 (the emulator, and a bare aiohttp pod with a hostile header)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from prefix_sidecar.membership.load_signals import LoadSignals, PodReport
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError
from prefix_sidecar.upstream.lean_http import PodAnswer
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator
from tests.fake_pod import start_site

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

BODY = json.dumps({"prompt": "hello", "max_tokens": 2, "stream": True}).encode()


class Recorder:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.headers: list[tuple[str, str | None]] = []

    def note_sent(self, url: str) -> None:
        self.sent.append(url)

    def observe_header(self, url: str, value: str | None) -> None:
        self.headers.append((url, value))


async def _stream_once(client: UpstreamClient, url: str) -> None:
    stream = await client.open(url, "/v1/completions", BODY, timeout_s=5.0, chat=False)
    async for _ in stream:
        pass
    stream.close()


@contextlib.asynccontextmanager
async def _bare_pod(
    handle: Handler,
) -> AsyncIterator[tuple[str, dict[str, int | None], LoadSignals, UpstreamClient]]:
    """A bare aiohttp pod answering /v1/completions with `handle`, and a client whose load
    readings go to `signals` (then to `loads`); the pod is not the only member, so a refused
    header cannot make it look like the whole fleet is saturated."""
    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner, base_url = await start_site(app)
    url = base_url
    loads: dict[str, int | None] = {}
    signals = LoadSignals(loads.__setitem__, over_cap=lambda u: 9)
    signals.set_members([url, "http://127.0.0.1:9"])
    client = UpstreamClient(load_observer=signals)
    try:
        yield url, loads, signals, client
    finally:
        await client.close()
        await runner.cleanup()


async def test_client_asks_and_reads_the_emulators_header() -> None:
    recorder = Recorder()
    client = UpstreamClient(load_observer=recorder)
    config = EmulatorConfig(time_scale=1000.0, load_header_on_streams=True)
    try:
        async with run_emulator(config) as url:
            await _stream_once(client, url)
    finally:
        await client.close()
    assert recorder.sent == [url]
    assert recorder.headers == [
        (
            url,
            "TEXT named_metrics.num_requests_waiting=0.0, named_metrics.kv_cache_usage_perc=0.0",
        )
    ]


async def test_vllm_streams_carry_no_header_and_nothing_is_asked_without_observer() -> None:
    recorder = Recorder()
    client = UpstreamClient(load_observer=recorder)
    plain = UpstreamClient()
    try:
        async with run_emulator(EmulatorConfig(time_scale=1000.0)) as url:
            await _stream_once(client, url)  # vLLM's behaviour: no header on streams
            await _stream_once(plain, url)
    finally:
        await client.close()
        await plain.close()
    assert recorder.headers == [(url, None)]


async def test_hostile_header_is_refused_and_the_request_still_succeeds() -> None:
    asked: list[str | None] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        asked.append(request.headers.get("endpoint-load-metrics-format"))
        await request.read()
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "endpoint-load-metrics": "TEXT named_metrics.num_requests_waiting=" + "9" * 4000,
            }
        )
        await response.prepare(request)
        event = {"choices": [{"text": "hi", "finish_reason": "stop"}]}
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    async with _bare_pod(handle) as (url, loads, signals, client):
        await _stream_once(client, url)
    assert asked == ["TEXT"]
    assert signals.headers_refused == 1 and loads == {}
    signals.observe(url, PodReport(waiting=1.0))  # an honest reading still counts
    assert loads == {url: 9}


async def _read_whole(answer: PodAnswer) -> bytes:
    parts = []
    while data := await answer.read():
        parts.append(data)
    answer.close()
    return b"".join(parts)


async def test_the_http_fronts_requests_ask_and_hand_over_too() -> None:
    """The HTTP front sends its own header set through post(): it asks for the report and
    hands it on."""
    recorder = Recorder()
    client = UpstreamClient(load_observer=recorder)
    plain = UpstreamClient()
    front_headers = {"Content-Type": "application/json", "User-Agent": "front"}
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()  # vLLM: not streamed
    try:
        async with run_emulator(EmulatorConfig(time_scale=1000.0)) as url:
            for _ in range(2):  # a new connection, then the kept one
                answer = await client.post(
                    url, "/v1/completions", body, front_headers, timeout_s=5.0
                )
                assert answer.status == 200 and b"choices" in await _read_whole(answer)
            answer = await plain.post(url, "/v1/completions", body, front_headers, timeout_s=5.0)
            await _read_whole(answer)
            assert "endpoint-load-metrics" not in answer.headers  # nobody asked
    finally:
        await client.close()
        await plain.close()
    assert front_headers == {"Content-Type": "application/json", "User-Agent": "front"}
    assert recorder.sent == [url, url]
    report = "TEXT named_metrics.num_requests_waiting=0.0, named_metrics.kv_cache_usage_perc=0.0"
    assert recorder.headers == [(url, report), (url, report)]


async def test_the_lean_client_bounds_a_hostile_header() -> None:
    """A pod's load header over the lean client's head bound fails that request (retryable
    at the front), and one within it but unparseable is refused by the readings."""

    async def handle(request: web.Request) -> web.Response:
        size = int(request.query.get("size", "10"))
        await request.read()
        return web.Response(
            text='{"choices": []}',
            headers={"endpoint-load-metrics": "TEXT named_metrics.x=" + "9" * size},
        )

    async with _bare_pod(handle) as (url, loads, signals, client):
        answer = await client.post(url, "/v1/completions?size=4000", b"{}", {}, timeout_s=5)
        assert answer.status == 200
        await _read_whole(answer)
        assert signals.headers_refused == 1 and loads == {}
        with pytest.raises(UpstreamError, match="headers are over"):
            await client.post(url, "/v1/completions?size=200000", b"{}", {}, timeout_s=5)
