"""Shutdown and restart (issue 7): the sidecar as a real `prefix-sidecar serve` process.

SIGTERM while streams run: health turns NOT_SERVING, new calls are refused with UNAVAILABLE,
the streams already running finish whole within the grace period, and the process exits 0.
A sidecar restarted with the same config routes every prompt exactly as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.emulator import EmulatorFleet, Faults
from prefix_sidecar_tools.harness import SidecarProcess
from tests.reliability.helpers_b import (
    FAULT_PODS,
    StreamResult,
    prefix_text,
    query,
    short_tmpdir,
    stream_complete,
    wait_all_serving,
)

GRACE_S = 5.0
STREAM_TOKENS = 700  # ~1 s at 700 tokens/s (35 tokens/s x time scale 20)


@pytest.fixture
async def fleet() -> AsyncIterator[EmulatorFleet]:
    async with EmulatorFleet(3, dataclasses.replace(FAULT_PODS, faults=Faults())) as pods:
        yield pods


async def test_sigterm_drains_streams_and_refuses_new_calls(fleet: EmulatorFleet) -> None:
    with short_tmpdir() as directory:
        serve_args = [arg for url in fleet.urls for arg in ("--backend", url)]
        serve_args += ["--set", f"grace_s={GRACE_S}", "--set", "health_interval_s=0.5"]
        sidecar = SidecarProcess(
            str(directory / "s.sock"), serve_args, log_path=str(directory / "log")
        )
        async with sidecar, grpc.aio.insecure_channel(sidecar.target) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            await wait_all_serving(stub, fleet.urls)
            first_tokens = asyncio.Semaphore(0)

            async def long_stream(number: int) -> tuple[StreamResult, float]:
                request = query("", f"a long script, caller {number}", max_tokens=STREAM_TOKENS)
                result = StreamResult()
                async for chunk in stub.Complete(request, timeout=30):
                    if result.chunks == 0:
                        first_tokens.release()
                    result.chunks += 1
                    result.text += chunk.text
                    result.finish_reason = chunk.finish_reason or result.finish_reason
                    if chunk.HasField("usage"):
                        result.usage = (0, chunk.usage.completion_tokens, 0)
                return result, time.perf_counter()

            streams = [asyncio.create_task(long_stream(n)) for n in range(8)]
            for _ in streams:
                await asyncio.wait_for(first_tokens.acquire(), 10)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

            terminated_at = time.perf_counter()
            sidecar.send_signal(signal.SIGTERM)
            # Health turns NOT_SERVING first, so probes and load balancers stop sending.
            update = await asyncio.wait_for(watch.read(), 2)
            assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            await asyncio.sleep(0.2)
            refused_old = await stream_complete(stub, query("", "too late"), timeout=5)
            async with grpc.aio.insecure_channel(sidecar.target) as fresh:
                fresh_stub = router_pb2_grpc.RouterStub(fresh)
                refused_new = await stream_complete(fresh_stub, query("", "too late"), timeout=5)

            finished = await asyncio.gather(*streams)
            assert sidecar.process is not None
            code = await asyncio.wait_for(sidecar.process.wait(), GRACE_S + 5)
            exited_at = time.perf_counter()
            socket_left = (directory / "s.sock").exists()
            log = sidecar.log_text()

    for refused in (refused_old, refused_new):
        assert refused.code == grpc.StatusCode.UNAVAILABLE and refused.chunks == 0, refused
    for result, done_at in finished:
        assert result.finish_reason == "length", result
        assert result.usage[1] == STREAM_TOKENS, "a draining stream was cut short"
        assert done_at - terminated_at < GRACE_S
    drained_s = max(done_at for _, done_at in finished) - terminated_at
    print(f"\nSIGTERM: 8 streams drained in {drained_s * 1e3:.0f} ms; exit code {code}")
    assert code == 0, log[-2000:]
    assert exited_at - terminated_at < GRACE_S + 2
    assert "draining" in log
    assert not socket_left, "the socket file was left behind"


def _prompts(prefix_texts: list[str], count: int = 1000) -> list[router_pb2.RouteRequest]:
    """Registered prefixes + a question, prefix names, and raw prompts of many sizes."""
    rng = random.Random(20240611)
    requests = []
    for number in range(count):
        kind = number % 10
        if kind < 4:
            text = prefix_texts[number % len(prefix_texts)] + f"\nmerchant question {number}"
            requests.append(router_pb2.RouteRequest(prompt=text))
        elif kind == 4:
            requests.append(router_pb2.RouteRequest(prefix_name=f"rules-{number % 3}"))
        else:
            size = rng.choice([10, 200, 4095, 4096, 4097, 20_000])
            text = "".join(rng.choice("abcdefghij klmnop\n") for _ in range(size))
            requests.append(router_pb2.RouteRequest(prompt=f"{number}:{text}"))
    return requests


async def _route_all(
    sidecar: SidecarProcess, urls: list[str], requests: list[router_pb2.RouteRequest]
) -> list[tuple[object, ...]]:
    async with grpc.aio.insecure_channel(sidecar.target) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await wait_all_serving(stub, urls, timeout=20)
        answers: list[tuple[object, ...]] = []
        for start in range(0, len(requests), 100):
            replies = await asyncio.gather(
                *(stub.Route(r, timeout=10) for r in requests[start : start + 100])
            )
            answers += [
                (r.backend, tuple(r.preference), r.prefix_id, r.route_key, r.branch)
                for r in replies
            ]
    return answers


async def test_restart_with_same_config_routes_identically(fleet: EmulatorFleet) -> None:
    with short_tmpdir() as directory:
        texts = [prefix_text(f"rules-{n}", 3000) for n in range(3)]
        prefixes = []
        for number, text in enumerate(texts):
            path = directory / f"rules-{number}.txt"
            path.write_text(text, encoding="utf-8")
            prefixes.append({"name": f"rules-{number}", "file": str(path)})
        config_file = directory / "sidecar.yaml"
        config_file.write_text(
            yaml.safe_dump(
                {
                    "backends": fleet.urls,
                    "prefixes": prefixes,
                    "health_interval_s": 0.5,
                    "grace_s": 1.0,
                }
            )
        )
        requests = _prompts(texts)
        args = ["--config", str(config_file)]
        socket = str(directory / "s.sock")
        runs = []
        for run in range(2):
            sidecar = SidecarProcess(socket, args, log_path=str(directory / f"log{run}"))
            async with sidecar:
                runs.append(await _route_all(sidecar, fleet.urls, requests))
            assert sidecar.process is not None and sidecar.process.returncode == 0
    before, after = runs
    assert len(before) == len(requests) == 1000
    differ = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert not differ, f"{len(differ)} prompts routed differently, e.g. #{differ[0]}"
    # The answers are not trivially equal: they spread over all the pods.
    assert {answer[0] for answer in before} == set(fleet.urls)
    assert len({answer[3] for answer in before}) >= 500  # many distinct route keys
    assert sum(1 for answer in before if answer[2]) >= 500  # matched a registered prefix
