"""Load counted in tokens (config load_unit, routing/cost.py) on a running sidecar in front of
emulated pods: a cold long prompt's prefill weighs on its pod until its first token, so a
thin query for a prefix homed there goes to the prefix's other home, where counting requests
sees a tie and keeps the first home. The cap's floor holds in both units."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from prefix_sidecar.config import ConfigError, build_config
from prefix_sidecar.routing.cost import DECODE_TOKENS, REQUEST_CAP_FLOOR
from prefix_sidecar.routing.prefix_affinity import PrefixAffinity
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator
from tests.server.conftest import running_sidecar, sidecar_config

RULES = "Store coupons apply before platform coupons; never stack two platform coupons. " * 50
# One H100-like emulated pod prefills 16k tokens/s: a 64 KB prompt (~16k tokens) holds its
# prefill for about a second, and answers stream for seconds after.
SLOW = EmulatorConfig(prefill_tps=16_000.0, decode_tps=20.0)


@contextlib.asynccontextmanager
async def two_pods(tmp_path: Path, unit: str) -> AsyncIterator[tuple[Any, Any, list[str]]]:
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(run_emulator(SLOW)) for _ in range(2)]
        config = sidecar_config(tmp_path, pods, load_unit=unit, load_signals=False)
        sidecar, stub = await stack.enter_async_context(running_sidecar(config))
        yield sidecar, stub, pods


async def first_chunk(call: Any) -> router_pb2.Chunk:
    chunk = await call.read()
    assert chunk is not grpc.aio.EOF
    return chunk


@pytest.mark.parametrize(("unit", "moved"), [("tokens", True), ("requests", False)])
async def test_a_cold_prefill_in_flight_sends_thin_queries_to_the_other_home(
    tmp_path: Path, unit: str, moved: bool
) -> None:
    async with two_pods(tmp_path, unit) as (_, stub, _):
        prefix = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name="r", text=RULES, replicas=2, prewarm=True)
        )
        first, second = prefix.backends
        # A long prompt nobody registered, routed to the prefix's first home.
        for n in range(200):
            cold = f"tenant {n} asks: " + "describe the down jacket offer. " * 2000
            if (await stub.Route(router_pb2.RouteRequest(prompt=cold))).backend == first:
                break
        thin = router_pb2.CompleteRequest(prefix_id=prefix.id, input="Q", max_tokens=100)
        long_call = stub.Complete(router_pb2.CompleteRequest(input=cold, max_tokens=4))
        await asyncio.sleep(0.05)  # sent, and prefilling
        # One thin stream in flight on the other home: one request on each pod now.
        thin_call = stub.Complete(thin)
        assert (await first_chunk(thin_call)).backend == second
        route = await stub.Route(router_pb2.RouteRequest(prefix_id=prefix.id))
        # Counted in requests both homes carry one and the first wins the tie; counted in
        # tokens the first carries ~16k of prefill and the second one thin stream.
        assert route.backend == (second if moved else first), route
        assert (await first_chunk(long_call)).backend == first
        long_call.cancel()
        thin_call.cancel()


@pytest.mark.parametrize("unit", ["tokens", "requests"])
async def test_streams_of_one_prefix_stay_home_below_the_floor(tmp_path: Path, unit: str) -> None:
    async with two_pods(tmp_path, unit) as (sidecar, stub, _):
        policy = sidecar.pools.default.router.policy
        assert isinstance(policy, PrefixAffinity)
        per_request = DECODE_TOKENS if unit == "tokens" else 1
        assert policy.load_cap_floor == REQUEST_CAP_FLOOR * per_request
        prefix = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name="r", text=RULES, prewarm=True)
        )
        thin = router_pb2.CompleteRequest(prefix_id=prefix.id, max_tokens=100)
        calls, routed = [], []
        for _ in range(4):
            routed.append(await stub.Route(router_pb2.RouteRequest(prefix_id=prefix.id)))
            call = stub.Complete(thin)
            calls.append(call)
            await first_chunk(call)  # in flight before the next is routed
        for call in calls:
            call.cancel()
    assert [(r.backend, r.branch) for r in routed] == [(prefix.backends[0], "home")] * 4


def test_the_unit_is_checked_and_the_old_floor_field_says_where_it_went() -> None:
    assert build_config({}).load_unit == "tokens"
    with pytest.raises(ConfigError, match="'load_unit' must be one of tokens, requests"):
        build_config({"load_unit": "bytes"})
    with pytest.raises(ConfigError, match=r"'load_cap_floor' .* REQUEST_CAP_FLOOR"):
        build_config({"load_cap_floor": 8})
