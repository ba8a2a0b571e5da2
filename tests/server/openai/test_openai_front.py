"""The OpenAI HTTP front, end to end: the official openai SDK (sync and async, streamed and
not) and curl against a real `prefix-sidecar serve --openai-listen` process, in front of
emulator pods or small aiohttp pods that record what reaches them and misbehave on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx2 as httpx
import openai
import pytest
from aiohttp import web

from prefix_sidecar.config import ConfigError, build_config
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.upstream.byte_relay import BACKEND_HEADER, BRANCH_HEADER
from prefix_sidecar_tools.emulator import run_emulator
from prefix_sidecar_tools.harness import SidecarProcess
from tests.server.conftest import (
    FAST,
    cli_env,
    free_port,
    running_sidecar,
    sidecar_config,
    socket_path,
)

KEY = "sk-configured-0123456789"
CALLER_KEY = "sk-caller-9876543210"
COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "text": "hi", "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Pod:
    """An aiohttp pod: /health answers 200; inference runs `handler` and records the raw
    body and headers of every request."""

    def __init__(self, handler: Handler | None = None) -> None:
        self.handler = handler or _answer_json
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.disconnected = asyncio.Event()
        self.url = ""

    async def infer(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.read())
        self.headers.append(dict(request.headers))
        return await self.handler(request)


async def _answer_json(_: web.Request) -> web.StreamResponse:
    return web.json_response(COMPLETION)


def _answers(status: int) -> Handler:
    async def handler(_: web.Request) -> web.StreamResponse:
        error = {"message": f"pod says {status}", "type": "x", "param": None, "code": status}
        return web.json_response({"error": error}, status=status)

    return handler


@contextlib.asynccontextmanager
async def running_pod(pod: Pod) -> AsyncIterator[Pod]:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", pod.infer)
    app.router.add_post("/v1/chat/completions", pod.infer)
    app.router.add_get("/health", _ok)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    pod.url = f"http://127.0.0.1:{port}"
    try:
        yield pod
    finally:
        await runner.cleanup()


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


@contextlib.asynccontextmanager
async def front(
    tmp_path: Path, backends: list[str], *args: str, **env: str
) -> AsyncIterator[tuple[str, SidecarProcess]]:
    """A real serve process with --openai-listen on loopback; yields its base URL."""
    port = free_port()
    argv = [f"--backend={url}" for url in backends]
    argv += ["--openai-listen", f"127.0.0.1:{port}", "--set", "health_interval_s=0.3"]
    argv += ["--set", "grace_s=1", *args]
    process = SidecarProcess(
        socket_path(tmp_path),
        argv,
        log_path=str(tmp_path / "serve.log"),
        env=cli_env(**env),
        start_timeout=20.0,
        backends_serving=len(backends),
    )
    async with process:
        yield f"http://127.0.0.1:{port}", process


@pytest.fixture
async def emulated(tmp_path: Path) -> AsyncIterator[tuple[str, SidecarProcess]]:
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(run_emulator(FAST, port=0)) for _ in range(2)]
        yield await stack.enter_async_context(front(tmp_path, pods))


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=CALLER_KEY, max_retries=0)


def async_sdk(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=CALLER_KEY, max_retries=0)


# --- the SDK against emulated pods ----------------------------------------------------------


async def test_the_sync_sdk_completes_and_chats_streamed_and_not(
    emulated: tuple[str, SidecarProcess],
) -> None:
    base, _ = emulated

    def run() -> None:
        with sdk(base) as client:
            model = client.models.list().data[0].id
            raw = client.completions.with_raw_response.create(
                model=model, prompt="rules " * 50 + "question", max_tokens=8
            )
            assert raw.headers[BACKEND_HEADER].startswith("http://127.0.0.1:")
            assert raw.headers[BRANCH_HEADER]
            completion = raw.parse()
            assert completion.choices[0].text and completion.usage is not None
            chat = client.chat.completions.create(
                model=model,
                messages=[
                    {"role": "system", "content": "you are terse"},
                    {"role": "user", "content": "hello"},
                ],
                max_tokens=8,
            )
            assert chat.choices[0].message.content
            chunks = list(
                client.completions.create(
                    model=model,
                    prompt="a streamed prompt",
                    max_tokens=8,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            assert "".join(c.choices[0].text for c in chunks if c.choices)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

    await asyncio.to_thread(run)


async def test_the_async_sdk_streams_a_chat(emulated: tuple[str, SidecarProcess]) -> None:
    base, _ = emulated
    async with async_sdk(base) as client:
        model = (await client.models.list()).data[0].id
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "stream me"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert text and usage is not None and usage.prompt_tokens > 0
        completion = await client.completions.create(model=model, prompt="x", max_tokens=4)
        assert completion.choices[0].text


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
async def test_curl_sees_sse_frames_ending_with_done(emulated: tuple[str, SidecarProcess]) -> None:
    base, _ = emulated
    async with aiohttp.ClientSession() as session, session.get(base + "/v1/models") as reply:
        model = (await reply.json())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "frames", "max_tokens": 6, "stream": True})
    curl = await asyncio.create_subprocess_exec(
        *("curl", "-sSN", "-X", "POST", base + "/v1/completions"),
        *("-H", "Content-Type: application/json", "-d", body),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(curl.communicate(), 20)
    assert curl.returncode == 0
    frames = out.decode().split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    for frame in frames[:-2]:
        assert frame.startswith("data: ")
        json.loads(frame[len("data: ") :])


async def test_health_and_unknown_paths(emulated: tuple[str, SidecarProcess]) -> None:
    base, _ = emulated
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/health") as reply:
            assert reply.status == 200
        async with session.post(base + "/v1/embeddings", json={}) as reply:
            assert reply.status == 404
            assert set((await reply.json())["error"]) == {"message", "type", "param", "code"}


# --- errors, as the SDK raises them ---------------------------------------------------------


async def test_errors_raise_the_sdks_exceptions(tmp_path: Path) -> None:
    async with (
        run_emulator(FAST, port=0) as pod,
        front(tmp_path, [pod], "--set", "max_message_bytes=65536") as (base, _),
    ):

        def run() -> None:
            with sdk(base) as client:
                with pytest.raises(openai.BadRequestError) as bad:
                    client.completions.create(model="m", prompt=None, max_tokens=4)
                assert bad.value.param == "prompt"
                with pytest.raises(openai.BadRequestError):
                    client.chat.completions.create(model="m", messages=[], max_tokens=4)
                with pytest.raises(openai.NotFoundError):
                    client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
                with pytest.raises(openai.APIStatusError) as big:
                    client.completions.create(model="m", prompt="x" * 70_000, max_tokens=4)
                assert big.value.status_code == 413
                assert big.value.code == "request_too_large"

        await asyncio.to_thread(run)


async def test_no_pod_is_a_503_with_retry_after(tmp_path: Path) -> None:
    async with (
        running_pod(Pod(_answers(503))) as bad,
        front(tmp_path, [bad.url]) as (base, _),
    ):

        def run() -> openai.APIStatusError:
            with sdk(base) as client, pytest.raises(openai.InternalServerError) as caught:
                client.completions.create(model="m", prompt="x", max_tokens=4)
            return caught.value

        error = await asyncio.to_thread(run)
        assert error.status_code == 503
        assert error.response.headers["Retry-After"] == "1"
        assert "no pod could serve" in str(error)


# --- the body and headers as the pod sees them -----------------------------------------------


async def test_the_pod_gets_the_callers_bytes_and_key(tmp_path: Path) -> None:
    raw = (
        b'{"prompt": "p\\u00e9",  "zeta": {"nested": [1, 2.50, 1e400]}, "model": "m",'
        b' "big": 123456789012345678901234567890, "max_tokens": 4}'
    )
    async with (
        running_pod(Pod()) as pod,
        front(tmp_path, [pod.url], PREFIX_SIDECAR_API_KEY=KEY) as (base, serve),
        aiohttp.ClientSession() as session,
    ):
        url = base + "/v1/completions"
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {CALLER_KEY}"}
        async with session.post(url, data=raw, headers=headers) as reply:
            assert reply.status == 200
            assert await reply.json() == COMPLETION
            assert reply.headers[BACKEND_HEADER] == pod.url
            assert CALLER_KEY not in str(reply.headers) and KEY not in str(reply.headers)
        async with session.post(url, data=raw, headers={"Content-Type": "application/json"}):
            pass
        assert pod.bodies == [raw, raw]
        assert pod.headers[0]["Authorization"] == f"Bearer {CALLER_KEY}"
        assert pod.headers[1]["Authorization"] == f"Bearer {KEY}"
    log = serve.log_text()
    assert CALLER_KEY not in log and KEY not in log


async def test_a_4xx_comes_back_as_the_pod_wrote_it_without_failover(tmp_path: Path) -> None:
    async with (
        running_pod(Pod(_answers(422))) as first,
        running_pod(Pod()) as second,
        front(tmp_path, [first.url, second.url]) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        for i in range(12):  # some prompts prefer the pod that says 422
            body = {"model": "m", "prompt": f"prompt {i}"}
            async with session.post(base + "/v1/completions", json=body) as reply:
                if reply.headers[BACKEND_HEADER] == first.url:
                    assert reply.status == 422
                    assert (await reply.json())["error"]["message"] == "pod says 422"
        assert first.bodies and len(first.bodies) + len(second.bodies) == 12


async def test_a_pod_answering_503_first_fails_over_before_the_first_byte(
    tmp_path: Path,
) -> None:
    async with (
        running_pod(Pod(_answers(503))) as bad,
        running_pod(Pod()) as good,
        front(tmp_path, [bad.url, good.url]) as (base, _),
    ):

        def run() -> None:
            with sdk(base) as client:
                for i in range(12):
                    raw = client.completions.with_raw_response.create(
                        model="m", prompt=f"prompt {i}", max_tokens=4
                    )
                    assert raw.headers[BACKEND_HEADER] == good.url
                    assert raw.parse().choices[0].text == "hi"

        await asyncio.to_thread(run)
        assert bad.bodies, "no prompt preferred the failing pod"
        assert len(good.bodies) == 12


# --- streams that break or are abandoned -----------------------------------------------------


def _event(text: str) -> bytes:
    chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m"}
    chunk["choices"] = [{"index": 0, "text": text, "finish_reason": None}]
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _streaming_pod(after_first: str) -> Pod:
    """A pod that sends one event, then `cut`s the connection or `trickle`s events until the
    caller goes (and then sets its `disconnected`)."""
    holder: list[Pod] = []
    pod = Pod(_streams_then(after_first, holder))
    holder.append(pod)
    return pod


def _streams_then(after_first: str, pod: list[Pod]) -> Handler:
    """Send one event, then `cut` the connection or `trickle` events until the caller goes."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_event("first"))
        if after_first == "cut":
            assert request.transport is not None
            request.transport.close()
            return response
        try:
            for _ in range(600):
                await asyncio.sleep(0.05)
                await response.write(_event("more"))
        except (ConnectionResetError, ConnectionError):
            pod[0].disconnected.set()
        return response

    return handler


async def test_a_stream_broken_after_the_first_byte_ends_with_an_error_event(
    tmp_path: Path,
) -> None:
    pod = _streaming_pod("cut")
    async with (
        running_pod(pod) as pod,
        front(tmp_path, [pod.url]) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        body = {"model": "m", "prompt": "x", "stream": True}
        async with session.post(base + "/v1/completions", json=body) as reply:
            assert reply.status == 200
            text = (await reply.read()).decode()
        frames = [f for f in text.split("\n\n") if f]
        assert frames[0].startswith("data: ") and "first" in frames[0]
        error = json.loads(frames[-1][len("data: ") :])["error"]
        assert "partial" in error["message"]
        assert "[DONE]" not in text

        def run() -> None:
            with sdk(base) as client, pytest.raises(openai.APIError):
                for _ in client.completions.create(model="m", prompt="x", stream=True):
                    pass

        await asyncio.to_thread(run)


async def test_a_caller_leaving_mid_stream_closes_the_pods_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    pod = _streaming_pod("trickle")
    async with (
        running_pod(pod) as pod,
        front(tmp_path, [pod.url]) as (base, _),
    ):
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                base + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}
            ) as reply,
        ):
            assert b"first" in await reply.content.readuntil(b"\n\n")
        # The session closed mid-stream: the sidecar must close the pod's connection.
        await asyncio.wait_for(pod.disconnected.wait(), 5)
        await asyncio.sleep(0.3)  # the next write to the caller finds it gone
    # A caller that leaves is no server error: no traceback, no "Error handling request".
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


# --- the listener ---------------------------------------------------------------------------


async def test_a_unix_socket_front_serves_the_sdk(tmp_path: Path) -> None:
    path = str(tmp_path / "openai.sock")
    async with (
        run_emulator(FAST, port=0) as url,
        SidecarProcess(
            socket_path(tmp_path),
            [f"--backend={url}", "--openai-listen", f"unix://{path}"],
            log_path=str(tmp_path / "serve.log"),
            env=cli_env(),
            backends_serving=1,
        ),
    ):

        def run() -> str:
            transport = httpx.HTTPTransport(uds=path)
            with openai.OpenAI(
                base_url="http://sidecar/v1",
                api_key="k",
                http_client=httpx.Client(transport=transport),
                max_retries=0,
            ) as client:
                model = client.models.list().data[0].id
                return client.completions.create(model=model, prompt="x", max_tokens=4).id

        assert await asyncio.to_thread(run)


def test_a_non_loopback_front_needs_tls() -> None:
    with pytest.raises(ConfigError, match="openai_listen"):
        build_config({"openai_listen": "0.0.0.0:8080", "backends": ["http://127.0.0.1:1"]})
    for listen in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "unix:///tmp/o.sock"):
        assert build_config({"openai_listen": listen}).openai_listen == listen
    with pytest.raises(ConfigError, match="openai_listen"):
        build_config({"openai_listen": "8080"})


async def test_an_openai_port_in_use_fails_start_and_leaves_nothing_open(
    tmp_path: Path,
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = int(holder.getsockname()[1])
        config = sidecar_config(tmp_path, ["http://127.0.0.1:9"], openai_listen=f"127.0.0.1:{port}")
        sidecar = Sidecar(config)
        with pytest.raises(OSError):
            await sidecar.start()
    assert sidecar.server is not None
    assert not await sidecar.server.wait_for_termination(timeout=1.0), "gRPC still runs"
    assert not sidecar.pools.default.client.lean._idle, "a pod connection was left open"
    assert not os.path.exists(config.socket_path)
    # The same port, free now: a sidecar starts on it and stops cleanly.
    async with running_sidecar(config, wait=False) as (running, _):
        assert running.openai is not None and running.openai.port == port
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/health") as reply,
        ):
            assert reply.status in (200, 503)
    with pytest.raises(aiohttp.ClientConnectorError):
        async with aiohttp.ClientSession() as session:
            await session.get(f"http://127.0.0.1:{port}/health")


async def test_a_thin_query_gets_the_registered_prefix_spliced_in(tmp_path: Path) -> None:
    rules = 'mega-sale rules: "no lowest price ever"\n双十一\n' * 20
    (tmp_path / "rules.txt").write_text(rules, encoding="utf-8")
    async with (
        running_pod(Pod()) as pod,
        front(tmp_path, [pod.url], "--prefix", f"rules={tmp_path / 'rules.txt'}") as (base, _),
    ):

        def run() -> None:
            with sdk(base) as client:
                raw = client.completions.with_raw_response.create(
                    model="m",
                    prompt="is this allowed?",
                    max_tokens=4,
                    extra_headers={"x-prefix-name": "rules"},
                )
                assert raw.headers[BRANCH_HEADER]
                client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "and this?"}],
                    extra_headers={"x-prefix-name": "rules"},
                )
                with pytest.raises(openai.NotFoundError) as unknown:
                    client.completions.create(
                        model="m", prompt="x", extra_headers={"x-prefix-name": "nope"}
                    )
                assert unknown.value.code == "prefix_not_found"
                with pytest.raises(openai.BadRequestError):
                    client.completions.create(
                        model="m",
                        prompt="x",
                        extra_headers={"x-prefix-name": "rules", "x-prefix-id": "abc"},
                    )

        await asyncio.to_thread(run)
    completion, chat = (json.loads(body) for body in pod.bodies[-2:])  # after the prewarm
    assert completion["prompt"] == rules + "is this allowed?"
    assert chat["messages"] == [
        {"role": "system", "content": rules},
        {"role": "user", "content": "and this?"},
    ]


async def test_http_requests_count_tokens_and_log_like_grpc_calls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        pod = await stack.enter_async_context(run_emulator(FAST, port=0))
        config = sidecar_config(tmp_path, [pod], openai_listen=f"127.0.0.1:{port}")
        sidecar, _ = await stack.enter_async_context(running_sidecar(config))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        async with session.get(f"http://127.0.0.1:{port}/v1/models") as reply:
            model = (await reply.json())["data"][0]["id"]
        caplog.set_level("INFO", logger="sidecar.requests")
        trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        for stream in (True, False):
            body = {"model": model, "prompt": "count me", "max_tokens": 5, "stream": stream}
            body["stream_options"] = {"include_usage": True} if stream else None
            async with session.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json=body,
                headers={"traceparent": trace},
            ) as reply:
                assert reply.status == 200, await reply.text()
                await reply.read()
        scrape = sidecar.metrics.render().decode()
        assert sidecar.pools.default.pool.backends[pod].in_flight == 0
    # The gRPC path's series, told apart by front="http" (and rpc=http_*).
    assert (
        f'prefix_sidecar_requests_total{{backend="{pod}",branch="home",front="http",'
        'pool="default",rpc="http_completions",status="OK"} 2.0'
    ) in scrape
    assert (
        'prefix_sidecar_decision_seconds_count{front="http",rpc="http_completions"} 2.0'
    ) in scrape
    assert f'prefix_sidecar_ttft_seconds_count{{backend="{pod}",front="http"}} 2.0' in scrape
    assert 'front="grpc"' not in scrape
    # Usage from the stream's last event and from the end of the whole answer: 5 + 5.
    assert 'prefix_sidecar_completion_tokens_total{prefix="-"} 10.0' in scrape
    lines = [r.getMessage() for r in caplog.records if r.name == "sidecar.requests"]
    assert len(lines) == 2, lines
    for line in lines:
        assert line.startswith(f"http_completions prefix=- backend={pod} pool=default branch=home")
        assert "status=OK" in line and "completion_tokens=5" in line
        assert f"traceparent={trace}" in line


async def test_a_whole_answer_cut_short_reaches_the_caller_as_a_cut_body(tmp_path: Path) -> None:
    async def cut_json(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"id": "cmpl-1", "choices": [{"text": "half')
        assert request.transport is not None
        request.transport.close()
        return response

    async with (
        running_pod(Pod(cut_json)) as pod,
        front(tmp_path, [pod.url]) as (base, serve),
        aiohttp.ClientSession() as session,
    ):
        async with session.post(
            base + "/v1/completions", json={"model": "m", "prompt": "x"}
        ) as reply:
            assert reply.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await reply.read()
        # The sidecar is fine and says what happened without a traceback.
        async with session.get(base + "/health") as reply:
            assert reply.status == 200
    log = serve.log_text()
    assert "status=PARTIAL" in log and "Traceback" not in log


async def test_a_large_body_passes_unchanged(tmp_path: Path) -> None:
    prompt = "双十一规则：不得宣称全网最低价。\n" * 80_000  # 7.5 MiB as \\u escapes: near the limit
    raw = json.dumps({"prompt": prompt, "model": "m", "unknown": [1.0, 2e5]}).encode()
    assert 7 * 2**20 < len(raw) < 8 * 2**20
    async with (
        running_pod(Pod()) as pod,
        front(tmp_path, [pod.url]) as (base, _),
        aiohttp.ClientSession() as session,
        session.post(
            base + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
        ) as reply,
    ):
        assert reply.status == 200
        assert pod.bodies == [raw]


# --- one relay, one set of series; the front's own stop ---------------------------------------


async def test_http_failovers_and_in_flight_are_counted_with_the_front_label(
    tmp_path: Path,
) -> None:
    port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        bad = await stack.enter_async_context(running_pod(Pod(_answers(503))))
        good = await stack.enter_async_context(running_pod(Pod()))
        config = sidecar_config(tmp_path, [bad.url, good.url], openai_listen=f"127.0.0.1:{port}")
        sidecar, _ = await stack.enter_async_context(running_sidecar(config))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        for i in range(12):
            body = {"model": "m", "prompt": f"prompt {i}"}
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as reply:
                assert reply.status == 200 and reply.headers[BACKEND_HEADER] == good.url
        registry = sidecar.metrics.registry
        failed = registry.get_sample_value(
            "prefix_sidecar_failovers_total",
            {"front": "http", "backend": bad.url, "reason": "http_503"},
        )
        assert failed == len(bad.bodies) > 0
        for url in (bad.url, good.url):
            in_flight = {"front": "http", "backend": url}
            assert registry.get_sample_value("prefix_sidecar_in_flight", in_flight) == 0
        assert 'front="grpc"' not in sidecar.metrics.render().decode()


@pytest.mark.timing
async def test_stop_drains_the_http_front_with_the_grace_it_is_given(tmp_path: Path) -> None:
    pod = _streaming_pod("trickle")
    port = free_port()
    async with running_pod(pod):
        config = sidecar_config(
            tmp_path, [pod.url], openai_listen=f"127.0.0.1:{port}", grace_s=60.0
        )
        sidecar = Sidecar(config)
        await sidecar.start()
        try:
            async with aiohttp.ClientSession() as session:
                await wait_serving_http(session, port)
                async with session.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"model": "m", "prompt": "x", "stream": True},
                ) as reply:
                    assert b"first" in await reply.content.readuntil(b"\n\n")
                    started = asyncio.get_running_loop().time()
                    await asyncio.wait_for(sidecar.stop(0.5), 10)
                    took = asyncio.get_running_loop().time() - started
                    assert 0.4 < took < 5, took  # the grace given, not the config's 60 s
                    with contextlib.suppress(aiohttp.ClientError):
                        await reply.read()  # the stream was cut when the grace ran out
            await asyncio.wait_for(pod.disconnected.wait(), 5)
        finally:
            await sidecar.stop(0)


async def wait_serving_http(session: aiohttp.ClientSession, port: int) -> None:
    for _ in range(100):
        async with session.get(f"http://127.0.0.1:{port}/health") as reply:
            if reply.status == 200:
                return
        await asyncio.sleep(0.05)
    raise AssertionError("the HTTP front never turned ready")
