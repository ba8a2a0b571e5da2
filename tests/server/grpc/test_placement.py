"""The KV budget (`home_kv_budget_tokens`, routing contract section 6) on a running sidecar:
prefixes the plain ring would stack on one pod are spread so that no pod is home to more
prefix tokens than the budget, and every part of the sidecar follows the same home sets:
RegisterPrefix/ListPrefixes, Route and Complete, Prewarm, warm-before-serve and /metrics.
place() and HomePlacer on their own: tests/routing/test_placement.py."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from prefix_sidecar import _core
from prefix_sidecar.config import ConfigError, build_config
from prefix_sidecar.routing import placement
from prefix_sidecar.routing.placement import Placed, place
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import run_emulator
from tests.server.conftest import FAST, collect, owner_ring, running_sidecar, sidecar_config

TOKENS = 1_000  # each prefix: 4,000 bytes, 1,000 tokens at 4 bytes per token
BUDGET = 3_000  # 12 prefixes x 1,000 tokens on 4 pods: exactly 3 per pod fit


def stacking_prefixes(pods: list[str]) -> list[str]:
    """12 texts whose route keys put more than BUDGET tokens on some pod of the plain ring
    (pods listen on random ports, so the texts are chosen for this run's ring)."""
    ring = owner_ring(pods)
    for salt in range(100):
        texts = [f"rules {salt}-{i} ".ljust(4 * TOKENS, "x") for i in range(12)]
        per_pod = dict.fromkeys(pods, 0)
        for text in texts:
            per_pod[ring.owner(_core.prefix_route_key(text))] += TOKENS
        if max(per_pod.values()) > BUDGET:
            return texts
    raise AssertionError("no stacking set found")  # ~98 % of random sets stack


async def test_the_budget_spreads_prefixes_and_everything_follows_it(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(run_emulator(FAST, port=0)) for _ in range(4)]
        texts = stacking_prefixes(pods)
        config = sidecar_config(tmp_path, pods, home_kv_budget_tokens=BUDGET)
        sidecar, stub = await stack.enter_async_context(running_sidecar(config))
        ids = []
        for i, text in enumerate(texts):
            reply = await stub.RegisterPrefix(
                router_pb2.RegisterPrefixRequest(name=f"p{i}", text=text)
            )
            ids.append(reply.id)
        listed = {
            p.id: list(p.backends)
            for p in (await stub.ListPrefixes(router_pb2.ListPrefixesRequest())).prefixes
        }

        ring = owner_ring(pods)
        expected = place(
            ring,
            [
                Placed(_core.prefix_route_key(t), TOKENS, 1, i)
                for t, i in zip(texts, ids, strict=True)
            ],
            BUDGET,
            placement.HOME_BALANCE_FACTOR,
        )
        homed = dict.fromkeys(pods, 0)
        for prefix_id in ids:
            assert listed[prefix_id] == [ring.members[m] for m in expected[prefix_id]]
            homed[listed[prefix_id][0]] += TOKENS
        assert max(homed.values()) <= BUDGET  # the plain ring put more on one pod

        for prefix_id in ids:  # Route and Complete go home
            route = await stub.Route(router_pb2.RouteRequest(prefix_id=prefix_id))
            assert (route.backend, route.branch) == (listed[prefix_id][0], "home")
            # Failover: the home set, then the key's preference order, max_attempts long.
            rest = ring.preference(route.route_key, len(pods))
            order = listed[prefix_id] + [m for m in rest if m not in listed[prefix_id]]
            assert list(route.preference) == order[: config.max_attempts]
        chunks = await collect(
            stub.Complete(router_pb2.CompleteRequest(prefix_id=ids[0], input="Q", max_tokens=2))
        )
        assert chunks[0].backend == listed[ids[0]][0]

        events = [e async for e in stub.Prewarm(router_pb2.PrewarmRequest(prefix_id=ids[1]))]
        warmed = [e.backend for e in events if e.state == router_pb2.PrewarmEvent.WARMED]
        assert warmed == listed[ids[1]]

        metrics = sidecar.metrics.render().decode()
        for url, tokens in homed.items():
            assert f'prefix_sidecar_home_prefix_tokens{{backend="{url}"}} {tokens:.1f}' in metrics
        assert re.search(
            r'^prefix_sidecar_home_kv_budget_tokens\{pool="default"\} 3000\.0$', metrics, re.M
        )


async def test_without_a_budget_homes_are_the_rings_first_owners(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(run_emulator(FAST, port=0)) for _ in range(3)]
        _, stub = await stack.enter_async_context(running_sidecar(sidecar_config(tmp_path, pods)))
        text = "rules ".ljust(4 * TOKENS, "y")
        reply = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name="r", text=text, replicas=2)
        )
        assert list(reply.backends) == owner_ring(pods).preference(reply.route_key, 2)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"home_kv_budget_tokens": -1}, "home_kv_budget_tokens"),
        ({"home_kv_budget_tokens": "lots"}, "home_kv_budget_tokens"),
    ],
)
def test_bad_budget_settings_are_refused_by_name(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(values)


def test_the_budget_is_off_by_default() -> None:
    config = build_config({})
    assert config.home_kv_budget_tokens == 0
