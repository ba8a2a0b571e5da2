"""Real vLLM pods for the tests in this folder: one fleet of two pods, one per core, shared
by the whole package (a pod takes 20-80 s to start on this machine kind), and a real
`prefix-sidecar serve` process in front of it per test module.

Skipped, with the reason, when the vLLM venv is missing (`make vllm-venv` creates it; CI
does). The tiny model is built once into .artifacts/vllm-tiny/ and reused.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio

from prefix_sidecar.config import Config
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.harness import SidecarProcess, child_env, free_port
from prefix_sidecar_tools.vllm.fleet import VllmFleet, ensure_tiny_model, vllm_python
from tests.server.conftest import running_sidecar, sidecar_config

# The pods the tests start run vLLM's engine core in the API server's process: one
# interpreter importing torch fewer, a pod ready in ~25 s instead of ~31-36 (here, one pod
# on one core). Production pods keep the default.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PODS = 2
# Seconds: a pod's start (the fleet fixture runs inside the first test's timeout) and a
# module's work on two CPU cores shared with other jobs.
TEST_TIMEOUT_S = 300

needs_vllm = pytest.mark.skipif(
    vllm_python() is None,
    reason="no vLLM venv (.venv-vllm, or the python in $PREFIX_SIDECAR_VLLM_PYTHON): run "
    "`make vllm-venv` to create it (CI does)",
)
# Every test here: marked, skipped without the venv, on the fleet fixture's event loop.
VLLM_TESTS = [
    pytest.mark.vllm,
    needs_vllm,
    pytest.mark.timeout(TEST_TIMEOUT_S),
    pytest.mark.asyncio(loop_scope="package"),
]


def processes_within(folder: Path) -> list[str]:
    """Live processes whose environment names `folder` (a pod's TMPDIR and caches are in
    its run's scratch folder, and its workers inherit them): `pid command` each."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(folder).encode() in (proc / "environ").read_bytes():
                found.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:120]!r}")
        except OSError:  # gone, or not ours
            continue
    return found


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def fleet() -> AsyncIterator[VllmFleet]:
    """Two pods for the package; on teardown, none of their processes may be left."""
    python = vllm_python()
    assert python is not None
    started = time.monotonic()
    async with VllmFleet(ensure_tiny_model(python), PODS, python=python) as running:
        ready = ", ".join(f"{pod.ready_s:.1f}" for pod in running.pods)
        print(f"\nvLLM fleet: {PODS} pods ready in {time.monotonic() - started:.1f} s ({ready})")
        yield running
    assert not processes_within(running.scratch), "vLLM processes outlived the fleet"


@pytest_asyncio.fixture(loop_scope="package")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        yield client


@contextlib.asynccontextmanager
async def serving_sidecar(
    fleet: VllmFleet, tmp_path: Path, *args: str
) -> AsyncIterator[tuple[SidecarProcess, str]]:
    """A real `prefix-sidecar serve` in front of the fleet, with the HTTP front on a free
    loopback port; yields the process (its gRPC target) and the front's base URL."""
    port = free_port()
    socket_dir = tempfile.mkdtemp(prefix="sc-")  # short: sun_path is ~107 bytes
    argv = [f"--backend={url}" for url in fleet.urls]
    argv += ["--openai-listen", f"127.0.0.1:{port}", "--set", f"model={fleet.model}"]
    argv += ["--set", "health_interval_s=0.5", "--set", "grace_s=1", *args]
    process = SidecarProcess(
        f"{socket_dir}/sidecar.sock",
        argv,
        log_path=str(tmp_path / "serve.log"),
        env=child_env(clean=True),
        start_timeout=30.0,
        backends_serving=len(fleet.urls),
    )
    try:
        async with process:
            yield process, f"http://127.0.0.1:{port}"
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def router_stub(
    fleet: VllmFleet, tmp_path: Path
) -> AsyncIterator[router_pb2_grpc.RouterStub]:
    """The gRPC Router of a `serving_sidecar` in front of the fleet."""
    async with (
        serving_sidecar(fleet, tmp_path) as (sidecar, _),
        grpc.aio.insecure_channel(sidecar.target) as channel,
    ):
        yield router_pb2_grpc.RouterStub(channel)


async def register_prewarmed(
    stub: router_pb2_grpc.RouterStub, name: str, text: str, replicas: int = 0
) -> router_pb2.Prefix:
    request = router_pb2.RegisterPrefixRequest(
        name=name, text=text, replicas=replicas, prewarm=True
    )
    return await stub.RegisterPrefix(request, timeout=120)


async def complete_usage(
    stub: router_pb2_grpc.RouterStub, prefix_id: str, query: str, max_tokens: int = 4
) -> tuple[str, dict[str, Any]]:
    """Complete(prefix_id, input=query), greedy, with raw_events: the pod that served it and
    the usage vLLM sent in its own last event (not the sidecar's Usage message)."""
    call = stub.Complete(
        router_pb2.CompleteRequest(
            prefix_id=prefix_id,
            input=query,
            max_tokens=max_tokens,
            temperature=0.0,
            raw_events=True,
        ),
        timeout=60,
    )
    chunks = [chunk async for chunk in call]
    events = [json.loads(event) for chunk in chunks for event in chunk.events]
    usages = [event["usage"] for event in events if event.get("usage")]
    assert usages, f"no pod event carried a usage: {events[-3:]}"
    return chunks[0].backend, dict(usages[-1])


def kv_sidecar_config(tmp_path: Path, fleet: VllmFleet, **values: Any) -> Config:
    """An in-process sidecar's config following `fleet`'s KV events: its model, and a first
    token within 60 s (pods that share two cores are slow when busy)."""
    return sidecar_config(
        tmp_path, fleet.urls, kv_events=True, model=fleet.model, first_token_timeout_s=60, **values
    )


@contextlib.asynccontextmanager
async def kv_sidecar(
    tmp_path: Path, fleet: VllmFleet, **values: Any
) -> AsyncIterator[tuple[Sidecar, Any, aiohttp.ClientSession]]:
    """That sidecar running (with its gRPC stub), and a client session for the pods."""
    async with (
        running_sidecar(kv_sidecar_config(tmp_path, fleet, **values)) as (sidecar, stub),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session,
    ):
        yield sidecar, stub, session


KV_BLOCK = 128
KV_BLOCKS = 64  # a small cache, so that a few prompts evict a prefix


def kv_events_fleet(pods: int) -> VllmFleet:
    """`pods` vLLM pods of KV_BLOCKS blocks each, publishing their KV events."""
    python = vllm_python()
    assert python is not None
    return VllmFleet(
        ensure_tiny_model(python),
        pods,
        python=python,
        kv_events=True,
        kv_cache_bytes=KV_BLOCKS * KV_BLOCK * 2048,  # 2,048 bytes a token (docs: VLLM-CPU.md)
        max_model_len=KV_BLOCKS // 2 * KV_BLOCK,  # vLLM keeps a little of the cache back
        block_size=KV_BLOCK,
    )
