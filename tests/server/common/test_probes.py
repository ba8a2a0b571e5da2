"""/livez and /readyz on the metrics port (prefix_sidecar/server/common/probes.py), and the standard
process_* metrics beside them.

The unit tests drive `Readiness` with pod states; the process tests run a real
`prefix-sidecar serve` against an emulated pod whose answers can be stalled, ejected and
revived, and ask the probes over HTTP what the kubelet would ask.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from prefix_sidecar.membership.pool import EJECTED, SERVING, WARMING
from prefix_sidecar.metrics import Metrics, start_metrics_server
from prefix_sidecar.server.common.probes import LIVE_PATH, READY_PATH, Readiness, probe_routes
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.emulator import run_emulator
from tests.server.conftest import FAST, backend_states, cli_sidecar, free_port, wait_for

# --- Readiness, unit ---------------------------------------------------------------------


def test_not_ready_without_members() -> None:
    readiness = Readiness()
    assert readiness.reason() == "no backends in the membership"
    readiness.observe([])
    assert readiness.reason() == "no backends in the membership"


def test_start_waits_for_every_first_member_to_finish_warming() -> None:
    readiness = Readiness()
    readiness.observe([WARMING, WARMING])
    assert readiness.reason() == "warming before serve: 2 of 2 pods warming, 0 serving"
    # One pod warm, the other still warming: the app's first requests would go cold.
    readiness.observe([SERVING, WARMING])
    assert readiness.reason() == "warming before serve: 1 of 2 pods warming, 1 serving"
    assert not readiness.started
    readiness.observe([SERVING, SERVING])
    assert readiness.reason() is None
    assert readiness.started


def test_a_first_member_that_fails_does_not_hold_start() -> None:
    readiness = Readiness()
    readiness.observe([SERVING, EJECTED])
    assert readiness.reason() is None


def test_a_later_joiner_warming_keeps_the_sidecar_ready() -> None:
    readiness = Readiness()
    readiness.observe([SERVING])
    readiness.observe([SERVING, WARMING])
    assert readiness.reason() is None


def test_not_ready_while_no_pod_is_serving() -> None:
    readiness = Readiness()
    readiness.observe([SERVING, SERVING])
    readiness.observe([EJECTED, WARMING])
    assert readiness.reason() == "no backend serving (1 ejected, 1 warming)"
    readiness.observe([SERVING, WARMING])
    assert readiness.reason() is None


def test_draining_is_final() -> None:
    readiness = Readiness()
    readiness.observe([SERVING])
    readiness.drain()
    assert readiness.reason() == "draining: shutting down"
    readiness.observe([SERVING, SERVING])
    assert readiness.reason() == "draining: shutting down"


# --- the endpoints, in process -------------------------------------------------------------


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
        return response.status, await response.text()


async def test_endpoints_answer_beside_metrics() -> None:
    readiness = Readiness()
    port = free_port()
    runner = await start_metrics_server(Metrics(), "127.0.0.1", port, probe_routes(readiness))
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            assert await get(session, base + LIVE_PATH) == (200, "ok\n")
            status, text = await get(session, base + READY_PATH)
            assert (status, text) == (503, "not ready: no backends in the membership\n")
            readiness.observe([SERVING])
            assert await get(session, base + READY_PATH) == (200, "ready\n")
            async with session.head(base + READY_PATH) as response:  # curl -I works too
                assert response.status == 200
            status, text = await get(session, base + "/metrics")
            assert status == 200
            for name in (
                "process_resident_memory_bytes",
                "process_open_fds",
                "process_cpu_seconds_total",
                "process_start_time_seconds",
                "python_info",
                "python_gc_collections_total",
            ):
                assert f"\n{name}" in text, f"/metrics lacks {name}"
    finally:
        await runner.cleanup()


# --- a real `prefix-sidecar serve` ---------------------------------------------------------

# The pod stalls every inference answer this long (real seconds): the prewarm at start too.
STALL_S = 1.5


@contextlib.asynccontextmanager
async def stallable_pod() -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    async with (
        run_emulator(FAST, port=0) as url,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
    ):
        yield url, session


async def set_faults(session: aiohttp.ClientSession, pod: str, **faults: object) -> None:
    async with session.post(f"{pod}/admin/faults", json=faults) as response:
        assert response.status == 200, await response.text()


@pytest.mark.timeout(60)
async def test_a_serve_process_is_ready_only_when_warm_serving_and_not_draining(
    tmp_path: Path,
) -> None:
    prefix = tmp_path / "rules.txt"
    prefix.write_text("You are the promotion compliance assistant. " * 40)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with stallable_pod() as (pod, session):
        await set_faults(session, pod, stall_seconds=STALL_S)
        args = [
            "--backend", pod, "--prefix", f"rules={prefix}:1",
            "--set", f"metrics_port={port}", "--set", "health_interval_s=0.2",
            "--set", "health_timeout_s=0.5", "--set", "eject_after_failures=1",
            "--set", "grace_s=10",
        ]  # fmt: skip
        started = time.monotonic()  # before the process: its prewarm starts after this
        async with cli_sidecar(tmp_path, args) as sidecar:
            # gRPC health says SERVING as soon as the socket is up; readiness waits for the
            # prewarm of the configured prefix, which the pod stalls.
            status, text = await get(session, base + READY_PATH)
            assert status == 503, text
            assert text.startswith("not ready: warming before serve: 1 of 1 pods warming"), text
            assert await get(session, base + LIVE_PATH) == (200, "ok\n")

            async def ready() -> bool:
                return (await get(session, base + READY_PATH))[0] == 200

            await wait_for(ready, 15, "/readyz 200 after the prewarm")
            assert time.monotonic() - started > STALL_S  # the stalled prewarm, whole
            await set_faults(session, pod, stall_seconds=0)
            async with grpc.aio.insecure_channel(sidecar.target) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                assert await backend_states(stub) == {pod: SERVING}
                listed = await stub.ListBackends(router_pb2.ListBackendsRequest())
                assert len(listed.backends[0].warm_prefixes) == 1, "ready before warm"
                _, metrics = await get(session, base + "/metrics")
                assert "\nprocess_resident_memory_bytes " in metrics
                assert "\nprocess_open_fds " in metrics

                # The only pod fails its health check: nothing can take traffic.
                await set_faults(session, pod, unhealthy=True)

                async def unready() -> bool:
                    return (await get(session, base + READY_PATH))[0] == 503

                await wait_for(unready, 10, "/readyz 503 once the pod is ejected")
                status, text = await get(session, base + READY_PATH)
                assert text == "not ready: no backend serving (1 ejected)\n"
                await set_faults(session, pod, unhealthy=False)
                await wait_for(ready, 10, "/readyz 200 once the pod is back")

                # SIGTERM during a stream: not ready at once, alive until the end.
                await set_faults(session, pod, stall_seconds=STALL_S)
                request = router_pb2.CompleteRequest(prefix_name="rules", input="q", max_tokens=2)
                stream = stub.Complete(request, timeout=20)
                await asyncio.sleep(0.3)  # the call is in flight, stalled at the pod
                sidecar.send_signal(signal.SIGTERM)
                await wait_for(unready, 5, "/readyz 503 after SIGTERM")
                status, text = await get(session, base + READY_PATH)
                assert text == "not ready: draining: shutting down\n"
                assert await get(session, base + LIVE_PATH) == (200, "ok\n")
                chunks = [chunk async for chunk in stream]
                assert chunks[-1].finish_reason == "length", "the draining stream was cut"
            assert sidecar.process is not None
            assert await asyncio.wait_for(sidecar.process.wait(), 15) == 0
