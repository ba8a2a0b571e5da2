"""Faults the sidecar must survive (issue 7, "Faults"), each against real pod processes.

Expected everywhere: a request that had received no token is retried on the next pod and
succeeds; one cut after its first token ends UNAVAILABLE with a message saying the text is
partial; the sidecar stays SERVING (polled on grpc.health.v1 all along); a dead pod leaves
within 2 s and comes back only healthy and warm; bad membership input keeps the last good
membership and logs an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorFleet, Faults, get_stats, set_faults
from tests.reliability.helpers_b import (
    FAULT_PODS,
    PREFIX_TOKENS,
    Client,
    DnsServer,
    ServingWatch,
    StreamResult,
    SwitchableResolver,
    backend_states,
    fault_config,
    query,
    register,
    running_sidecar,
    short_tmpdir,
    stream_complete,
    wait_all_serving,
    wait_logged,
    wait_state,
)

EJECT_WITHIN_S = 2.0


@pytest.fixture
async def fleet() -> AsyncIterator[EmulatorFleet]:
    """Two pod processes; a test may kill, restart and fault them."""
    config = dataclasses.replace(FAULT_PODS, faults=Faults())
    async with EmulatorFleet(2, config) as pods:
        yield pods


@pytest.fixture
async def client(fleet: EmulatorFleet) -> AsyncIterator[Client]:
    with short_tmpdir() as directory:
        async with running_sidecar(fault_config(directory, backends=fleet.urls)) as running:
            await wait_all_serving(running.stub, fleet.urls)
            yield running


async def _route(client: Client, prefix: str) -> str:
    reply = await client.stub.Route(router_pb2.RouteRequest(prefix_name=prefix), timeout=5)
    return reply.backend


# --- kill -9 ---------------------------------------------------------------------------------


async def test_kill_9_under_load_loses_nothing_and_ejects_within_2s() -> None:
    """24 callers stream through the sidecar; the prefix's home pod is SIGKILLed mid-load."""
    config = dataclasses.replace(FAULT_PODS, faults=Faults())
    async with EmulatorFleet(3, config) as pods:
        with short_tmpdir() as directory:
            async with running_sidecar(fault_config(directory, backends=pods.urls)) as client:
                await wait_all_serving(client.stub, pods.urls)
                home = (await register(client, "rules")).backends[0]
                results: list[StreamResult] = []
                stop = asyncio.Event()

                async def caller(number: int) -> None:
                    sent = 0
                    while not stop.is_set():
                        request = query("rules", f"caller {number} query {sent}", max_tokens=200)
                        results.append(await stream_complete(client.stub, request, timeout=10))
                        sent += 1

                async with ServingWatch(client.health) as watch:
                    callers = [asyncio.create_task(caller(n)) for n in range(24)]
                    await asyncio.sleep(1.0)
                    before_kill = len(results)
                    killed_at = time.perf_counter()
                    await pods.kill(pods.urls.index(home))
                    await wait_state(client.stub, home, "ejected", timeout=5, every_s=0.01)
                    eject_s = time.perf_counter() - killed_at
                    await asyncio.sleep(1.0)
                    stop.set()
                    await asyncio.gather(*callers)
                    watch.assert_always_serving()

    outcomes = Counter(r.outcome for r in results)
    print(f"\nkill -9 of {home}: ejected after {eject_s * 1e3:.0f} ms; outcomes {dict(outcomes)}")
    lost = [str(r) for r in results if r.outcome == "lost"]
    assert not lost, f"{len(lost)} requests lost that could have been retried: {lost[:3]}"
    assert eject_s < EJECT_WITHIN_S, f"dead pod ejected after {eject_s:.2f} s"
    assert before_kill > 0 and outcomes["ok"] > before_kill
    # The kill cut streams mid-answer, and requests sent to the dead pod before its
    # ejection were moved to the next pod: both paths were really exercised.
    assert outcomes["partial"] >= 1, outcomes
    assert outcomes["ok_after_failover"] >= 1, outcomes
    for result in results:
        if result.partial:
            assert result.backend == home and result.text, result


async def test_dead_pod_comes_back_only_healthy_and_warm(
    fleet: EmulatorFleet, client: Client
) -> None:
    home = (await register(client, "rules")).backends[0]
    other = next(url for url in fleet.urls if url != home)
    victim = fleet.urls.index(home)
    async with ServingWatch(client.health) as watch:
        await fleet.kill(victim)
        await wait_state(client.stub, home, "ejected", timeout=EJECT_WITHIN_S)

        # Back on the same port, but /health says 503 and its prefills stall for 1.5 s.
        fleet.config.faults = Faults(unhealthy=True, stall_seconds=1.5)
        await fleet.restart(victim)
        fleet.config.faults = Faults()
        for _ in range(12):  # 1.2 s: several health checks answer 503
            assert (await backend_states(client.stub))[home] == "ejected"
            assert await _route(client, "rules") == other
            await asyncio.sleep(0.1)

        # Healthy now: it must first be warmed with the prefix it is home for.
        await set_faults(home, unhealthy=False)
        await wait_state(client.stub, home, "warming", timeout=3)
        assert await _route(client, "rules") == other, "a warming pod took traffic"
        await set_faults(home, stall_seconds=0.0)  # only the prewarm already sent stalls
        warming_s = await wait_state(client.stub, home, "serving", timeout=5)
        print(f"\nre-admission: warming for {warming_s * 1e3:.0f} ms, then serving")

        result = await stream_complete(client.stub, query("rules", "first after re-admission"))
        watch.assert_always_serving()
    assert result.ok and result.backend == home, result
    _, _, cached = result.usage
    assert cached >= PREFIX_TOKENS - 16, f"first request after re-admission was cold: {result}"
    prefills = (await get_stats(home))["prefills"]
    assert [p["cached_tokens"] > 0 for p in prefills] == [False, True], prefills


# --- pods that answer badly ------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 429, 503])
async def test_error_status_moves_to_next_pod(
    fleet: EmulatorFleet, client: Client, status: int
) -> None:
    home = (await register(client, "rules")).backends[0]
    await set_faults(home, fail_next=3, fail_status=status)
    async with ServingWatch(client.health) as watch:
        failed_over = [
            await stream_complete(client.stub, query("rules", f"question {n}")) for n in range(3)
        ]
        after = await stream_complete(client.stub, query("rules", "question 3"))
        watch.assert_always_serving(at_least=2)
    for result in failed_over:
        assert result.ok and result.attempts == 2 and result.backend != home, result
    # A pod that refused three requests is not dead: affinity comes back to it at once.
    assert after.ok and after.attempts == 1 and after.backend == home, after


@pytest.mark.timing
@pytest.mark.parametrize("budget", ["deadline", "first_token_timeout"])
async def test_stalled_pod_does_not_eat_the_deadline(fleet: EmulatorFleet, budget: str) -> None:
    """The home pod sends nothing for 4 s; the request moves on within its budget."""
    first_token_timeout = 60.0 if budget == "deadline" else 0.5
    deadline = 2.0 if budget == "deadline" else 10.0
    expected_switch = 1.0 if budget == "deadline" else 0.5  # half the deadline, or the budget
    with short_tmpdir() as directory:
        config = fault_config(
            directory, backends=fleet.urls, first_token_timeout_s=first_token_timeout
        )
        async with running_sidecar(config) as client:
            await wait_all_serving(client.stub, fleet.urls)
            home = (await register(client, "rules")).backends[0]
            await set_faults(home, stall_seconds=4.0)
            async with ServingWatch(client.health) as watch:
                result = await stream_complete(
                    client.stub, query("rules", "stalled?"), timeout=deadline
                )
                watch.assert_always_serving(at_least=2)
            await set_faults(home, stall_seconds=0.0)
    assert result.ok and result.attempts == 2 and result.backend != home, result
    assert expected_switch * 0.9 <= result.seconds < min(deadline, expected_switch + 1.0), result


@pytest.mark.parametrize("fault", ["drop_after_chunks", "malformed_after_chunks"])
@pytest.mark.parametrize("after_events", [0, 3])
async def test_broken_stream(
    fleet: EmulatorFleet, client: Client, fault: str, after_events: int
) -> None:
    """The home pod closes its SSE stream, or sends broken JSON, after N events."""
    home = (await register(client, "rules")).backends[0]
    await set_faults(home, **{fault: after_events})
    request = query("rules", "write the script", max_tokens=64)
    async with ServingWatch(client.health) as watch:
        broken = await stream_complete(client.stub, request)
        watch.assert_always_serving(at_least=2)
    if after_events == 0:  # nothing reached the caller: retried on the next pod
        assert broken.ok and broken.attempts == 2 and broken.backend != home, broken
        return
    assert broken.partial and broken.backend == home and broken.text, broken
    assert not broken.finish_reason
    # The caller keeps what it got and knows it is cut: greedy decoding gives the same
    # answer again, and what arrived is a strict prefix of it.
    await set_faults(home, **{fault: None})
    whole = await stream_complete(client.stub, request)
    assert whole.ok and whole.backend == home, whole
    assert whole.text.startswith(broken.text) and len(whole.text) > len(broken.text)


# --- membership that goes bad ----------------------------------------------------------------


async def test_dns_empty_or_failing_keeps_last_good(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    config = dataclasses.replace(FAULT_PODS, faults=Faults())
    resolver = SwitchableResolver("vllm.pods.test", ["127.0.0.1"])
    async with EmulatorFleet(1, config) as pods:
        url = pods.urls[0]
        with DnsServer(resolver) as dns, short_tmpdir() as directory:
            async with running_sidecar(dns.sidecar_config(directory, pods.ports[0])) as client:
                await wait_all_serving(client.stub, [url])
                async with ServingWatch(client.health) as watch:
                    for mode, reason in (("empty", "returned no backends"), ("servfail", "failed")):
                        caplog.clear()
                        resolver.mode = mode
                        logged = await wait_logged(caplog, "keeping the last good membership")
                        assert reason in logged and "vllm.pods.test" in logged, logged
                        assert any(
                            r.levelno == logging.ERROR
                            for r in caplog.records
                            if "last good" in r.getMessage()
                        )
                        await dns.wait_queries(4)  # a few more polls: still no change
                        assert await backend_states(client.stub) == {url: "serving"}
                        result = await stream_complete(client.stub, query("", f"while {mode}"))
                        assert result.ok and result.backend == url, result
                    resolver.mode = "records"
                    await wait_logged(caplog, "recovered")
                    watch.assert_always_serving()


GARBAGE = [
    b"\x00\xff\xfe\x80 not text at all",
    b"backends: [http://127.0.0.1:1, unclosed",
    b"[]",
    b"{backends: [42]}",
    b"",
]


async def test_garbage_backends_file_keeps_last_good(
    fleet: EmulatorFleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with short_tmpdir() as directory:
        backends_file = directory / "backends.yaml"
        _replace(backends_file, "\n".join(f"- {url}" for url in fleet.urls).encode())
        config = fault_config(directory, backends_file=str(backends_file))
        async with running_sidecar(config) as client:
            await wait_all_serving(client.stub, fleet.urls)
            async with ServingWatch(client.health) as watch:
                for garbage in GARBAGE:
                    caplog.clear()
                    _replace(backends_file, garbage)
                    logged = await wait_logged(caplog, "keeping the last good membership")
                    assert str(backends_file) in logged, logged
                    await asyncio.sleep(0.3)  # three more polls of the same garbage
                    assert await backend_states(client.stub) == dict.fromkeys(
                        fleet.urls, "serving"
                    ), garbage
                    result = await stream_complete(client.stub, query("", f"after {garbage!r}"))
                    assert result.ok, result
                # The watcher is still alive: a good file is adopted again.
                _replace(backends_file, f"- {fleet.urls[1]}\n".encode())
                await wait_state(client.stub, fleet.urls[0], "absent", timeout=3)
                watch.assert_always_serving()


def _replace(path: Path, data: bytes) -> None:
    """Swap the file in one rename, as a ConfigMap update does."""
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
