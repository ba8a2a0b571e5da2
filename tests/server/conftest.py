"""Real parts for the sidecar server tests: emulator pods on 127.0.0.1, a running Sidecar on
a unix socket in tmp_path, and a gRPC stub dialing it.

Pods run in this process (`run_emulator`) unless a test needs to kill one; the sidecar is
the real `Sidecar` with its real health checks, so every fixture waits until the sidecar
itself reports the pods "serving" instead of assuming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_sidecar import _core
from prefix_sidecar.config import Config, build_config
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.emulator import EmulatorConfig, get_stats, run_emulator
from prefix_sidecar_tools.harness import SidecarProcess, child_env, free_port

# Functional tests: 1000x faster than real time, every stage still modelled.
FAST = EmulatorConfig(time_scale=1000.0)
REPO = Path(__file__).resolve().parents[2]


def sidecar_config(tmp_path: Path, backends: list[str], **values: Any) -> Config:
    """A test config: socket in tmp_path, quick health checks, the given pods."""
    merged: dict[str, Any] = {
        "listen": f"unix://{socket_path(tmp_path)}",
        "backends": backends,
        "health_interval_s": 0.5,
        "health_timeout_s": 0.5,
        "file_interval_s": 0.1,
        "grace_s": 2.0,
        "first_token_timeout_s": 5.0,
    }
    merged.update(values)
    return build_config(merged)


def socket_path(tmp_path: Path, name: str = "sidecar.sock") -> str:
    path = str(tmp_path / name)
    assert len(path) < 100, f"unix socket path too long for sun_path: {path}"
    return path


async def wait_for(
    predicate: Callable[[], Awaitable[bool] | bool], timeout: float = 5.0, what: str = ""
) -> None:
    """Poll until predicate() is true; fail naming `what` after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = predicate()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or predicate}")
        await asyncio.sleep(0.02)


async def backend_states(stub: Any) -> dict[str, str]:
    reply = await stub.ListBackends(router_pb2.ListBackendsRequest())
    return {b.url: b.state for b in reply.backends}


async def wait_serving(stub: Any, urls: list[str], timeout: float = 5.0) -> None:
    """Wait until the sidecar reports exactly these pods, all serving."""

    async def ready() -> bool:
        states = await backend_states(stub)
        return sorted(states) == sorted(urls) and all(s == "serving" for s in states.values())

    await wait_for(ready, timeout, f"{urls} to be serving")


@contextlib.asynccontextmanager
async def running_sidecar(config: Config, wait: bool = True) -> AsyncIterator[tuple[Sidecar, Any]]:
    """Start a Sidecar, dial it, wait for its static pods to serve; stop both after."""
    async with (
        Sidecar(config) as sidecar,
        grpc.aio.insecure_channel(sidecar.target) as channel,
    ):
        stub = router_pb2_grpc.RouterStub(channel)
        if wait and config.backends and not config.backends_file and not config.backends_dns:
            await wait_serving(stub, [url for url, _ in config.backends])
        yield sidecar, stub


@pytest.fixture
async def pods() -> AsyncIterator[list[str]]:
    """Three emulator pods in this process."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(run_emulator(FAST, port=0)) for _ in range(3)]


@pytest.fixture
async def sidecar(pods: list[str], tmp_path: Path) -> AsyncIterator[Sidecar]:
    async with running_sidecar(sidecar_config(tmp_path, pods)) as (running, _):
        yield running


@pytest.fixture
async def stub(sidecar: Sidecar) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(sidecar.target) as channel:
        yield router_pb2_grpc.RouterStub(channel)


async def collect(call: Any) -> list[router_pb2.Chunk]:
    return [chunk async for chunk in call]


async def cached_tokens(pod: str, text: str) -> int:
    """The tokens of `text` the pod at `pod` already holds: its cached_tokens for the text
    and a short question, asked straight, not through a sidecar."""
    body = {"prompt": text + " May coupons stack?", "max_tokens": 1}
    async with (
        aiohttp.ClientSession() as session,
        session.post(pod + "/v1/completions", json=body) as response,
    ):
        answer = await response.json()
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def owner_ring(urls: list[str]) -> _core.Ring:
    """The routing contract's ring, built here independently of the sidecar's pool."""
    return _core.Ring(sorted(urls), [1] * len(urls))


async def requests_per_pod(urls: list[str]) -> dict[str, int]:
    """Inference requests each pod has received (from the emulator's own counters)."""
    stats = await asyncio.gather(*(get_stats(url) for url in urls))
    return {url: int(s["requests"]) for url, s in zip(urls, stats, strict=True)}


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a `prefix-sidecar` subprocess: this checkout first on the path,
    no PREFIX_SIDECAR_* leaking in from the test runner."""
    return child_env(clean=True, **extra)


CLI = [sys.executable, "-m", "prefix_sidecar.cli"]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port nothing listens on: connecting to it is refused."""
    yield free_port()


async def health_status(target: str, service: str = "", timeout: float = 1.0) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return int(reply.status)


@contextlib.asynccontextmanager
async def cli_sidecar(
    tmp_path: Path, args: list[str], name: str = "cli", **env: str
) -> AsyncIterator[SidecarProcess]:
    """Start `prefix-sidecar serve --listen unix://... ARGS` (the tools' harness), wait until
    its health service answers SERVING, and SIGTERM it afterwards (SIGKILL if it overstays)."""
    sidecar = SidecarProcess(
        socket_path(tmp_path, f"{name}.sock"),
        args,
        log_path=str(tmp_path / f"{name}.log"),
        env=cli_env(**env),
        start_timeout=15.0,
    )
    async with sidecar:
        yield sidecar
