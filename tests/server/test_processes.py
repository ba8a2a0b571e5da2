"""Real `prefix-sidecar serve` processes: graceful shutdown on SIGTERM, and two sidecars
that never talk to each other routing 10,000 prompts identically."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_sidecar import _core
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.emulator import EmulatorConfig, get_stats, run_emulator

from .conftest import FAST, cli_sidecar, owner_ring, sidecar_config, wait_for, wait_serving

SECRET = "sk-live-3f9a1c-never-log-me"


@pytest.mark.timing
async def test_sigterm_drains_the_stream_refuses_new_calls_and_exits_0(tmp_path: Path) -> None:
    # x20: 600 tokens take ~0.9 s, long enough to probe the sidecar while it drains.
    async with contextlib.AsyncExitStack() as stack:
        pod = await stack.enter_async_context(run_emulator(EmulatorConfig(time_scale=20.0)))
        sidecar = await stack.enter_async_context(
            cli_sidecar(
                tmp_path,
                ["--backend", pod, "--set", "grace_s=5", "--set", "health_interval_s=0.5"],
                PREFIX_SIDECAR_API_KEY=SECRET,
            )
        )
        assert sidecar.process is not None
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(sidecar.target))
        stub = router_pb2_grpc.RouterStub(channel)
        await wait_serving(stub, [pod])
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

        stream = stub.Complete(router_pb2.CompleteRequest(input="long script", max_tokens=600))
        chunks: list[Any] = [await stream.read()]
        sent_at = time.perf_counter()
        sidecar.process.send_signal(signal.SIGTERM)

        update = await asyncio.wait_for(watch.read(), 2.0)
        assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()

        async with grpc.aio.insecure_channel(sidecar.target) as fresh:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await router_pb2_grpc.RouterStub(fresh).Route(
                    router_pb2.RouteRequest(prompt="hi"), timeout=2.0
                )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert sidecar.process.returncode is None, "exited before the stream finished"

        try:
            while (chunk := await stream.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
        except grpc.aio.AioRpcError as lost:  # say what the sidecar did, not only the stream
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(sidecar.process.wait(), 5.0)
            pytest.fail(
                f"the draining stream failed after {len(chunks)} chunks: {lost.code()} "
                f"{lost.details()}; sidecar exit {sidecar.process.returncode}, log tail:\n"
                + sidecar.log_text()[-3000:]
            )
        code = await asyncio.wait_for(sidecar.process.wait(), 5.0)
        elapsed = time.perf_counter() - sent_at

    assert chunks[-1].usage.completion_tokens == 600
    assert sum(len(c.text.split()) for c in chunks) == 600
    assert code == 0
    assert elapsed < 5.0
    assert not os.path.exists(sidecar.socket_path), "the socket file was left behind"
    logs = sidecar.log_text()
    assert "status=OK" in logs and "prefix-sidecar stopped" in logs
    assert SECRET not in logs


async def test_two_sidecar_processes_route_10000_prompts_identically(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(run_emulator(FAST, port=0)) for _ in range(5)]
        config = tmp_path / "sidecar.yaml"
        # Listed in a different order than the ring sorts them: order must not matter.
        config.write_text(
            "backends:\n" + "".join(f"  - {url}\n" for url in reversed(pods)), encoding="utf-8"
        )
        stubs = []
        for name in ("a", "b"):
            sidecar = await stack.enter_async_context(
                cli_sidecar(tmp_path, ["--config", str(config)], name=name)
            )
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(sidecar.target))
            stubs.append(router_pb2_grpc.RouterStub(channel))
        for stub in stubs:
            await wait_serving(stub, pods, timeout=10.0)

        prompts = [
            f"tenant {i}: compliance check of promotion rule set {i * 7919}" for i in range(10_000)
        ]
        answers = []
        started = time.perf_counter()
        for stub in stubs:
            backends: list[str] = []
            for start in range(0, len(prompts), 1000):
                replies = await asyncio.gather(
                    *(
                        stub.Route(router_pb2.RouteRequest(prompt=p))
                        for p in prompts[start : start + 1000]
                    )
                )
                backends.extend(r.backend for r in replies)
            answers.append(backends)
        elapsed = time.perf_counter() - started

    ring = owner_ring(pods)
    expected = [ring.owner(_core.route_key(p.encode())) for p in prompts]
    assert answers[0] == answers[1]
    assert answers[0] == expected
    counts = {url: answers[0].count(url) for url in pods}
    assert min(counts.values()) > 10_000 / 5 * 0.7, counts  # all pods really share the work
    print(f"20,000 Route calls over two sidecar processes in {elapsed:.1f} s")


@pytest.mark.timing
async def test_a_stream_outlasting_the_grace_period_is_cut_and_the_pod_freed(
    tmp_path: Path,
) -> None:
    # x20: 3000 tokens would take ~4 s; the grace period is 0.3 s.
    async with run_emulator(EmulatorConfig(time_scale=20.0), port=0) as pod:
        sidecar = Sidecar(sidecar_config(tmp_path, [pod], grace_s=0.3))
        stopping: asyncio.Task[None] | None = None
        await sidecar.start()
        try:
            async with grpc.aio.insecure_channel(sidecar.target) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                await wait_serving(stub, [pod])
                call = stub.Complete(router_pb2.CompleteRequest(input="long", max_tokens=3000))
                assert (await call.read()).text
                started = time.perf_counter()
                stopping = asyncio.create_task(sidecar.stop())
                with pytest.raises(grpc.aio.AioRpcError):
                    while await call.read() is not grpc.aio.EOF:
                        pass
                await asyncio.wait_for(stopping, 3.0)
                elapsed = time.perf_counter() - started
        finally:
            if stopping is None:
                await sidecar.stop()

        async def freed() -> bool:
            stats = await get_stats(pod)
            return bool(stats["running"] == 0 and stats["aborted"] == 1)

        await wait_for(freed, timeout=1.0, what="the pod to see the cut stream aborted")
    assert 0.25 <= elapsed < 1.5, f"stop() took {elapsed:.2f} s with a 0.3 s grace period"
