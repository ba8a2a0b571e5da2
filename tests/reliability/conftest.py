"""Shared parts for the bad-input and security tests: one fuzz target (an emulator pod and a
sidecar, each a real process) per module, certificate generation, and a tiny aiohttp
"pod" that records request headers or answers garbage.

The part-B tests (faults, soak, shutdown) keep their own fixtures in their own files.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from sidecar.fuzz import Fuzzer, FuzzTarget


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


@dataclass
class FakePod:
    """An aiohttp server on 127.0.0.1 speaking just enough of vLLM: /health answers 200,
    inference paths run `handler`; every request's headers are recorded."""

    url: str
    headers: list[dict[str, str]] = field(default_factory=list)


def sse_ok(text: str = "hello") -> bytes:
    """A well-formed one-token completion stream with usage."""
    events = [
        {"choices": [{"index": 0, "text": text, "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
    ]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


async def _ok(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(sse_ok())
    await response.write_eof()
    return response


@pytest.fixture
async def fake_pod() -> AsyncIterator[Callable[[Handler | None], Awaitable[FakePod]]]:
    """`pod = await fake_pod(handler)`: start a pod whose inference paths run `handler`."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler | None = None) -> FakePod:
        pod = FakePod(url="")
        inference = handler or _ok

        async def record(request: web.Request) -> web.StreamResponse:
            pod.headers.append(dict(request.headers))
            await request.read()
            return await inference(request)

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", record)
        app.router.add_post("/v1/chat/completions", record)
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
