"""Hot prefixes under concurrent load (replica sets and bounded-load spill on the sidecar's
own in-flight counts), prewarm retries, inline prefixes, and the in-process serve()."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest

from prefix_sidecar import _core
from prefix_sidecar.routing.cost import REQUEST_CAP_FLOOR
from prefix_sidecar.server.app import Sidecar, serve
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator, set_faults
from tests.server.conftest import FAST, collect, owner_ring, running_sidecar, sidecar_config

RULES = "Cross-store discount priority: platform coupon first, then store coupon. " * 100
FLOOR = REQUEST_CAP_FLOOR


@pytest.mark.parametrize(("replicas", "streams"), [(2, 4), (1, 11)])
async def test_concurrent_streams_spread_as_the_contract_pick_says(
    tmp_path: Path, replicas: int, streams: int
) -> None:
    """Each request is picked with the loads of the streams already in flight; the result
    must be what Ring.pick gives for the same sequence of loads."""
    # x20: 300 tokens take ~0.4 s, so every stream is still running when the last starts.
    async with contextlib.AsyncExitStack() as stack:
        config = EmulatorConfig(time_scale=20.0)
        pods = [await stack.enter_async_context(run_emulator(config, port=0)) for _ in range(3)]
        # Loads in requests, the floor REQUEST_CAP_FLOOR: 11 streams on one home must spill.
        plain = sidecar_config(tmp_path, pods, load_unit="requests")
        _, stub = await stack.enter_async_context(running_sidecar(plain))
        prefix = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name="hot", text=RULES, replicas=replicas)
        )
        request = router_pb2.CompleteRequest(prefix_id=prefix.id, input="Q", max_tokens=300)
        calls = []
        for _ in range(streams):
            call = stub.Complete(request)
            calls.append((call, await call.read()))  # in flight before the next one starts
        during = await stub.Route(router_pb2.RouteRequest(prefix_id=prefix.id))
        listed = await stub.ListBackends(router_pb2.ListBackendsRequest())
        for call, _ in calls:
            while await call.read() is not grpc.aio.EOF:
                pass
        after = await stub.ListBackends(router_pb2.ListBackendsRequest())

    ring = owner_ring(pods)
    loads = dict.fromkeys(ring.members, 0)
    expected = []
    for _ in range(streams):
        url, _branch = ring.pick(prefix.route_key, list(loads.values()), replicas, 1.25, FLOOR)
        loads[url] += 1
        expected.append(url)
    assert [first.backend for _, first in calls] == expected
    assert {b.url: b.in_flight for b in listed.backends} == loads
    assert (during.backend, during.branch) == ring.pick(
        prefix.route_key, list(loads.values()), replicas, 1.25, FLOOR
    )
    home = ring.preference(prefix.route_key, replicas)
    assert set(expected[:replicas]) == set(home), "the replica set takes the first requests"
    if replicas == 1:
        assert len(set(expected)) > 1, "a hot prefix must spill beyond its one home pod"
        assert max(Counter(expected).values()) < streams
    assert all(b.in_flight == 0 for b in after.backends)


async def test_prewarm_retries_with_backoff_and_reports_each_state(
    tmp_path: Path, pods: list[str]
) -> None:
    config = sidecar_config(tmp_path, pods)  # three attempts (prewarm.ATTEMPTS)
    async with running_sidecar(config) as (_, stub):
        prefix = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="r", text=RULES))
        owner = prefix.backends[0]
        await set_faults(owner, fail_next=1, fail_status=503)
        events = [e async for e in stub.Prewarm(router_pb2.PrewarmRequest(prefix_id=prefix.id))]
        await set_faults(owner, fail_next=5, fail_status=500)
        failed = [e async for e in stub.Prewarm(router_pb2.PrewarmRequest(prefix_id=prefix.id))]
        await set_faults(owner, fail_next=0)

    state = router_pb2.PrewarmEvent.State
    assert [(e.state, e.attempt) for e in events] == [
        (state.STARTED, 1),
        (state.RETRYING, 1),
        (state.STARTED, 2),
        (state.WARMED, 2),
    ]
    assert "503" in events[1].error
    assert events[-1].prompt_tokens == (len(RULES.encode()) + 3) // 4
    assert [(e.state, e.attempt) for e in failed][-2:] == [(state.STARTED, 3), (state.FAILED, 3)]
    assert "500" in failed[-1].error


async def test_a_pod_refusing_the_prewarm_fails_at_once(tmp_path: Path, pods: list[str]) -> None:
    config = sidecar_config(tmp_path, pods, model="no-such-model")  # the pods answer 404
    async with running_sidecar(config) as (_, stub):
        prefix = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="r", text=RULES))
        events = [e async for e in stub.Prewarm(router_pb2.PrewarmRequest(prefix_id=prefix.id))]
    state = router_pb2.PrewarmEvent.State
    assert [(e.state, e.attempt) for e in events] == [(state.STARTED, 1), (state.FAILED, 1)]
    assert "does not exist" in events[-1].error


async def test_an_inline_prefix_routes_like_the_registered_one(
    sidecar: Sidecar, stub: Any, pods: list[str]
) -> None:
    key = _core.route_key(RULES.encode())
    owner = owner_ring(pods).owner(key)
    inline = await collect(
        stub.Complete(router_pb2.CompleteRequest(prefix_text=RULES, input="Q1", max_tokens=1))
    )
    prefix = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="r", text=RULES))
    registered = await collect(
        stub.Complete(router_pb2.CompleteRequest(prefix_id=prefix.id, input="Q2", max_tokens=1))
    )
    assert prefix.route_key == key
    assert inline[0].backend == registered[0].backend == owner
    # The inline request put the prefix in the owner's cache; the registered one used it.
    assert registered[-1].usage.cached_tokens >= len(RULES) // 4 - 16


async def test_unregistering_one_name_keeps_another_name_with_the_same_text(
    sidecar: Sidecar, stub: Any
) -> None:
    await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="tenant-a", text=RULES))
    await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="tenant-b", text=RULES))
    await stub.UnregisterPrefix(router_pb2.UnregisterPrefixRequest(prefix_name="tenant-b"))
    reply = await stub.Route(router_pb2.RouteRequest(prefix_name="tenant-a"))
    assert reply.prefix_id


async def test_serve_runs_until_the_shutdown_trigger(tmp_path: Path) -> None:
    async with run_emulator(FAST, port=0) as pod:
        config = sidecar_config(tmp_path, [pod])
        stop = asyncio.Event()
        started: list[Sidecar] = []
        task = asyncio.create_task(serve(config, shutdown_trigger=stop.wait, ready=started.append))
        while not started:
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(config.listen) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            reply = await stub.ListBackends(router_pb2.ListBackendsRequest())
            assert [b.url for b in reply.backends] == [pod]
        stop.set()
        await asyncio.wait_for(task, 5.0)
    assert not os.path.exists(config.socket_path)


async def test_a_burst_of_2500_concurrent_calls_is_served(sidecar: Sidecar, stub: Any) -> None:
    results = await asyncio.gather(
        *(stub.Route(router_pb2.RouteRequest(prompt=f"burst {i}")) for i in range(2500)),
        return_exceptions=True,
    )
    failed = Counter(r.code().name for r in results if isinstance(r, grpc.aio.AioRpcError))
    assert not failed, f"{sum(failed.values())} of 2500 calls failed: {dict(failed)}"
