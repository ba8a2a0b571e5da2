"""Shared parts for the bad-input and security tests: one fuzz target (an emulator pod and a
sidecar, each a real process) per module, certificate generation, and a tiny aiohttp
"pod" that records request headers or answers garbage.

The part-B tests (faults, soak, shutdown) keep their own fixtures in their own files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from prefix_sidecar_tools.fuzz import Fuzzer, FuzzTarget

from prefix_sidecar.config import Config, build_config
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc


@pytest.fixture(scope="module")
def fuzz_target() -> Iterator[FuzzTarget]:
    target = FuzzTarget()
    with target:
        yield target
    target.cleanup()


@pytest.fixture(scope="module")
def fuzzer(fuzz_target: FuzzTarget) -> Fuzzer:
    return Fuzzer(fuzz_target, timeout_s=10.0, probe_every=250)


# --- certificates --------------------------------------------------------------------------


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA nobody trusts, with a client cert it signed
    other_client_cert: Path
    other_client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
             "-subj", f"/CN={name}", cwd=directory)  # fmt: skip


def _leaf(directory: Path, name: str, ca: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
             cwd=directory)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
             cwd=directory)  # fmt: skip


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A CA, a server cert for 127.0.0.1/localhost and a client cert, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to generate test certificates")
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
          "extendedKeyUsage=serverAuth\n")  # fmt: skip
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "intruder", "other-ca", "extendedKeyUsage=clientAuth\n")
    return Certs(
        ca=d / "ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        client_cert=d / "client.pem",
        client_key=d / "client.key",
        other_ca=d / "other-ca.pem",
        other_client_cert=d / "intruder.pem",
        other_client_key=d / "intruder.key",
    )


# --- a tiny pod that records or misbehaves ---------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def ok_stream(request: web.Request) -> web.StreamResponse:
    """A well-behaved pod's answer (completions format; chat clients ignore `text`)."""
    chat = request.path.endswith("/chat/completions")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(sse_ok(chat=chat))
    await response.write_eof()
    return response


@dataclass
class FakePod:
    """An aiohttp server on 127.0.0.1 speaking just enough of vLLM: /health answers 200,
    inference paths run `handler` (swap it to change behaviour); request headers and
    bodies are recorded."""

    url: str
    handler: Handler = ok_stream
    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)

    def behave(self) -> None:
        """From now on answer like a healthy pod."""
        self.handler = ok_stream


def sse_ok(text: str = "hello", chat: bool = False) -> bytes:
    """A well-formed one-token stream with usage."""
    piece = {"delta": {"content": text}} if chat else {"text": text}
    events = [
        {"choices": [{"index": 0, **piece, "finish_reason": None}]},
        {"choices": [{"index": 0, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
    ]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


@pytest.fixture
async def fake_pod() -> AsyncIterator[Callable[..., Awaitable[FakePod]]]:
    """`pod = await fake_pod(handler)`: start a pod whose inference paths run `handler`."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler = ok_stream) -> FakePod:
        pod = FakePod(url="", handler=handler)

        async def inference(request: web.Request) -> web.StreamResponse:
            pod.headers.append(dict(request.headers))
            pod.bodies.append(await request.read())
            return await pod.handler(request)

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", inference)
        app.router.add_post("/v1/chat/completions", inference)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        pod.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return pod

    yield start
    for runner in runners:
        await asyncio.wait_for(runner.cleanup(), 5)


# --- an in-process sidecar ---------------------------------------------------------------------


def sidecar_config(tmp_path: Path, backends: list[str], **values: object) -> Config:
    """A test config: socket in tmp_path, quick health checks, the given pods."""
    merged: dict[str, object] = {
        "listen": f"unix://{tmp_path}/sidecar.sock",
        "backends": backends,
        "health_interval_s": 0.5,
        "health_timeout_s": 0.5,
        "grace_s": 1.0,
        "first_token_timeout_s": 5.0,
    }
    merged.update(values)
    return build_config(merged)


@contextlib.asynccontextmanager
async def running_sidecar(config: Config) -> AsyncIterator[tuple[Sidecar, Any]]:
    """Start a Sidecar, dial it, wait until its static pods serve; stop both after."""
    async with (
        Sidecar(config) as sidecar,
        grpc.aio.insecure_channel(sidecar.target) as channel,
    ):
        stub = router_pb2_grpc.RouterStub(channel)
        urls = sorted(url for url, _ in config.backends)
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            reply = await stub.ListBackends(router_pb2.ListBackendsRequest())
            states = {b.url: b.state for b in reply.backends}
            if sorted(states) == urls and set(states.values()) == {"serving"}:
                break
            assert asyncio.get_running_loop().time() < deadline, f"pods never served: {states}"
            await asyncio.sleep(0.02)
        yield sidecar, stub


@pytest.fixture
def start_sidecar(tmp_path: Path) -> Callable[..., contextlib.AbstractAsyncContextManager[Any]]:
    """`async with start_sidecar([url, ...], **config_fields) as (sidecar, stub):`"""

    def start(backends: list[str], **values: object) -> contextlib.AbstractAsyncContextManager[Any]:
        return running_sidecar(sidecar_config(tmp_path, backends, **values))

    return start
