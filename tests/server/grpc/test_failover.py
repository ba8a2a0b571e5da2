"""Failover before the first token, UNAVAILABLE after it, cancellation and deadlines.

Each test picks a prefix whose contract owner is the pod it breaks, so the first attempt
surely meets the fault and the expected next pod is the owner's ring successor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from prefix_sidecar import _core
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorConfig, get_stats, run_emulator, set_faults
from tests.server.conftest import (
    FAST,
    collect,
    owner_ring,
    running_sidecar,
    sidecar_config,
    wait_for,
)


def prefix_owned_by(pods: list[str], owner: str) -> str:
    """A prefix text whose contract owner (over these pods) is `owner`."""
    ring = owner_ring(pods)
    for i in range(10_000):
        text = f"Rules for tenant {i}: " + "stacked coupons apply after store discounts. " * 20
        if ring.owner(_core.route_key(text.encode())) == owner:
            return text
    raise AssertionError("no prefix found for the owner")  # pragma: no cover


def successor(pods: list[str], text: str) -> str:
    return owner_ring(pods).preference(_core.route_key(text.encode()), 2)[1]


@contextlib.asynccontextmanager
async def three_pods(config: EmulatorConfig = FAST) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(run_emulator(config, port=0)) for _ in range(3)]


def complete(text: str, max_tokens: int = 4) -> router_pb2.CompleteRequest:
    return router_pb2.CompleteRequest(prefix_text=text, input="Q: ok?", max_tokens=max_tokens)


@pytest.mark.parametrize("status", [500, 429, 503])
async def test_http_error_before_first_token_moves_to_the_next_pod(
    status: int, tmp_path: Path, pods: list[str]
) -> None:
    text = prefix_owned_by(pods, pods[0])
    async with running_sidecar(sidecar_config(tmp_path, pods)) as (_, stub):
        await set_faults(pods[0], fail_next=1, fail_status=status)
        chunks = await collect(stub.Complete(complete(text)))
    assert chunks[0].backend == successor(pods, text)
    assert chunks[0].attempts == 2
    assert chunks[-1].usage.completion_tokens == 4
    assert (await get_stats(pods[0]))["completed"] == 0


async def test_refused_connection_moves_to_the_next_pod(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        dying = contextlib.AsyncExitStack()
        stack.push_async_callback(dying.aclose)
        pods = [await dying.enter_async_context(run_emulator(FAST, port=0))]
        pods += [await stack.enter_async_context(run_emulator(FAST, port=0)) for _ in range(2)]
        text = prefix_owned_by(pods, pods[0])
        # A high ejection threshold keeps the dead pod on the ring, as it is between the
        # moment a pod dies and the moment health checks notice. The window route makes the
        # unregistered Route below land where the prefix's key does (organic would not).
        config = sidecar_config(
            tmp_path, pods, eject_after_failures=100, unregistered_routing="window"
        )
        _, stub = await stack.enter_async_context(running_sidecar(config))
        await dying.aclose()  # the owner's port now refuses connections
        route = await stub.Route(router_pb2.RouteRequest(prefix_id="", prompt=text))
        assert route.backend == pods[0], "the dead pod must still be the owner for this test"
        chunks = await collect(stub.Complete(complete(text)))
    assert chunks[0].backend == successor(pods, text)
    assert chunks[0].attempts == 2
    assert chunks[-1].usage.completion_tokens == 4


async def test_malformed_stream_before_first_token_moves_to_the_next_pod(
    tmp_path: Path, pods: list[str]
) -> None:
    text = prefix_owned_by(pods, pods[0])
    async with running_sidecar(sidecar_config(tmp_path, pods)) as (_, stub):
        await set_faults(pods[0], malformed_after_chunks=0)
        chunks = await collect(stub.Complete(complete(text)))
    assert (chunks[0].backend, chunks[0].attempts) == (successor(pods, text), 2)


@pytest.mark.timing
async def test_stall_past_the_first_token_budget_moves_to_the_next_pod(
    tmp_path: Path, pods: list[str]
) -> None:
    text = prefix_owned_by(pods, pods[0])
    config = sidecar_config(tmp_path, pods, first_token_timeout_s=0.3)
    async with running_sidecar(config) as (_, stub):
        await set_faults(pods[0], stall_seconds=0.9)
        started = time.perf_counter()
        chunks = await collect(stub.Complete(complete(text)))
        elapsed = time.perf_counter() - started
        await set_faults(pods[0], stall_seconds=0)
    assert (chunks[0].backend, chunks[0].attempts) == (successor(pods, text), 2)
    assert 0.3 <= elapsed < 0.85, f"took {elapsed:.2f} s with a 0.3 s first-token budget"


async def test_every_pod_failing_is_unavailable_with_each_reason(
    tmp_path: Path, pods: list[str]
) -> None:
    async with running_sidecar(sidecar_config(tmp_path, pods)) as (_, stub):
        for url in pods:
            await set_faults(url, fail_next=1, fail_status=503)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub.Complete(complete("some prefix ")))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    details = info.value.details() or ""
    assert "3 attempt(s)" in details
    assert all(url in details for url in pods)


async def test_stream_broken_after_first_token_is_unavailable_and_says_partial(
    tmp_path: Path,
) -> None:
    # Slow decode (x20) so the first tokens reach the caller before the cut.
    async with three_pods(EmulatorConfig(time_scale=20.0)) as pods:
        text = prefix_owned_by(pods, pods[0])
        async with running_sidecar(sidecar_config(tmp_path, pods)) as (_, stub):
            await set_faults(pods[0], drop_after_chunks=10)
            received: list[Any] = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for chunk in stub.Complete(complete(text, max_tokens=60)):
                    received.append(chunk)
            others = [(await get_stats(url))["requests"] for url in pods[1:]]
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "partial" in (info.value.details() or "")
    assert received and received[0].backend == pods[0]
    words = sum(len(c.text.split()) for c in received)
    assert 1 <= words <= 10, f"{words} tokens relayed from a stream cut after 10 events"
    assert others == [0, 0], "a stream that already sent text must not be replayed elsewhere"


@pytest.mark.timing
async def test_cancelled_call_aborts_the_pod_request_promptly(tmp_path: Path) -> None:
    # x20: 2000 tokens would take ~3 s to decode; the cancel must stop it at once.
    async with (
        run_emulator(EmulatorConfig(time_scale=20.0), port=0) as pod,
        running_sidecar(sidecar_config(tmp_path, [pod])) as (_, stub),
    ):
        call = stub.Complete(
            router_pb2.CompleteRequest(input="write a long script", max_tokens=2000)
        )
        first = await call.read()
        assert first.text
        assert (await get_stats(pod))["running"] == 1
        cancelled_at = time.perf_counter()
        call.cancel()

        async def aborted() -> bool:
            stats = await get_stats(pod)
            return bool(stats["running"] == 0 and stats["aborted"] == 1)

        await wait_for(aborted, timeout=1.0, what="the pod to see the request aborted")
        elapsed = time.perf_counter() - cancelled_at
        stats = await get_stats(pod)
        backends = await stub.ListBackends(router_pb2.ListBackendsRequest())
    assert elapsed < 0.5
    assert stats["completed"] == 0
    assert stats["generation_tokens"] < 1000
    assert backends.backends[0].in_flight == 0


@pytest.mark.timing
@pytest.mark.parametrize("stalled", [1, 2])
async def test_short_deadline_on_stalled_pods_is_deadline_exceeded_quickly(
    stalled: int, tmp_path: Path
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(run_emulator(FAST, port=0)) for _ in range(stalled)]
        _, stub = await stack.enter_async_context(running_sidecar(sidecar_config(tmp_path, pods)))
        for url in pods:
            await set_faults(url, stall_seconds=0.9)
        started = time.perf_counter()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub.Complete(complete("deadline test "), timeout=0.4))
        elapsed = time.perf_counter() - started
        for url in pods:
            await set_faults(url, stall_seconds=0)
        # The sidecar is fine afterwards and the in-flight counts came back to zero.
        await asyncio.sleep(0.05)
        backends = await stub.ListBackends(router_pb2.ListBackendsRequest())
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < 0.8, f"a 0.4 s deadline took {elapsed:.2f} s"
    assert [b.in_flight for b in backends.backends] == [0] * stalled


async def test_deadline_expiring_mid_stream_is_deadline_exceeded_and_frees_the_pod(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # x20: 600 tokens take ~0.9 s; a 0.3 s deadline ends the stream after its first tokens.
    caplog.set_level(logging.INFO)
    async with (
        run_emulator(EmulatorConfig(time_scale=20.0), port=0) as pod,
        running_sidecar(sidecar_config(tmp_path, [pod])) as (_, stub),
    ):
        for attempt in range(2):
            received: list[Any] = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for chunk in stub.Complete(
                    router_pb2.CompleteRequest(input=f"long {attempt}", max_tokens=600),
                    timeout=0.3,
                ):
                    received.append(chunk)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
            assert received, "the first tokens should have arrived before the deadline"

        async def freed() -> bool:
            stats = await get_stats(pod)
            return bool(stats["running"] == 0 and stats["aborted"] == 2)

        await wait_for(freed, timeout=1.0, what="the pod to see both requests aborted")
    unexpected = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not unexpected, f"a deadline is not an internal error: {unexpected}"


async def test_max_attempts_bounds_the_failover(tmp_path: Path, pods: list[str]) -> None:
    text = prefix_owned_by(pods, pods[0])
    second = successor(pods, text)
    config = sidecar_config(tmp_path, pods, max_attempts=2)
    async with running_sidecar(config) as (_, stub):
        await set_faults(pods[0], fail_next=1, fail_status=503)
        await set_faults(second, fail_next=1, fail_status=503)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub.Complete(complete(text)))
        third = next(url for url in pods if url not in (pods[0], second))
        assert (await get_stats(third))["requests"] == 0
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "2 attempt(s)" in (info.value.details() or "")
