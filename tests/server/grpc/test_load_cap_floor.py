"""The load-cap floor (`load_cap_floor`, pick's min_cap in routing contract v1) on a running
sidecar: at low traffic a hot prefix's concurrent streams stay on its warm home pod instead of
spilling to a pod that would prefill the whole prefix again."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import grpc
import pytest

from prefix_sidecar.config import ConfigError, build_config
from prefix_sidecar.routing.prefix_affinity import PrefixAffinity
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator
from tests.server.conftest import owner_ring, running_sidecar, sidecar_config

RULES = "Store coupons apply before platform coupons; never stack two platform coupons. " * 100


@pytest.mark.parametrize(
    ("floor", "streams", "branches"),
    [
        (None, 2, ["home", "home"]),  # the default floor, 8
        (0, 2, ["home", "spill"]),  # the plain formula: cap = ceil(1.25 * 2 / 4) = 1
        (2, 3, ["home", "home", "spill"]),  # a floor, not a pin: the 3rd is over it
    ],
    ids=["default-floor", "floor-0", "floor-2"],
)
async def test_concurrent_streams_of_one_prefix_stay_home_below_the_floor(
    tmp_path: Path, floor: int | None, streams: int, branches: list[str]
) -> None:
    """Streams start one after another, each still in flight when the next is routed; every
    one goes where Ring.pick with the same floor says, with the sidecar's own loads."""
    # x20: 300 tokens take ~0.4 s, so every stream is still running when the last starts.
    async with contextlib.AsyncExitStack() as stack:
        slow = EmulatorConfig(time_scale=20.0)
        pods = [await stack.enter_async_context(run_emulator(slow, port=0)) for _ in range(4)]
        values: dict[str, Any] = {} if floor is None else {"load_cap_floor": floor}
        config = sidecar_config(tmp_path, pods, **values)
        sidecar, stub = await stack.enter_async_context(running_sidecar(config))
        prefix = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="r", text=RULES))
        request = router_pb2.CompleteRequest(prefix_id=prefix.id, input="Q", max_tokens=300)
        calls = []
        routed = []
        for _ in range(streams):
            # Route first (no upstream traffic): the branch the next request is about to take.
            routed.append(await stub.Route(router_pb2.RouteRequest(prefix_id=prefix.id)))
            call = stub.Complete(request)
            calls.append((call, await call.read()))  # in flight before the next one starts
        listed = await stub.ListBackends(router_pb2.ListBackendsRequest())
        for call, _ in calls:
            while await call.read() is not grpc.aio.EOF:
                pass

    policy = sidecar.pools.default.router.policy
    assert isinstance(policy, PrefixAffinity)
    assert policy.load_cap_floor == (8 if floor is None else floor)
    ring = owner_ring(pods)
    home = ring.owner(prefix.route_key)
    loads = dict.fromkeys(ring.members, 0)
    expected = []
    for _ in range(streams):
        url, branch = ring.pick(
            prefix.route_key, list(loads.values()), 1, 1.25, config.load_cap_floor
        )
        loads[url] += 1
        expected.append((url, branch))
    assert [branch for _, branch in expected] == branches
    assert [(r.backend, r.branch) for r in routed] == expected
    assert [first.backend for _, first in calls] == [url for url, _ in expected]
    assert {b.url: b.in_flight for b in listed.backends} == loads
    assert calls[0][1].backend == home
    if branches[1] == "home":
        assert calls[1][1].backend == home, "the 2nd stream must share the warm home pod"
    else:
        assert calls[1][1].backend != home


def test_the_floor_is_validated_and_defaults_to_eight() -> None:
    assert build_config({}).load_cap_floor == 8
    assert build_config({"load_cap_floor": 0}).load_cap_floor == 0
    env = {"PREFIX_SIDECAR_LOAD_CAP_FLOOR": "32"}
    assert build_config({}, env=env).load_cap_floor == 32
    with pytest.raises(ConfigError, match="'load_cap_floor' must be >= 0"):
        build_config({"load_cap_floor": -1})
    with pytest.raises(ConfigError, match="'load_cap_floor' must be an integer"):
        build_config({"load_cap_floor": "many"})
