"""Routing matches the contract's owner, and the pod that owner names is the one that serves.

The expected pod comes from a Ring built here over the same members (sorted urls), not
from the sidecar, and "served" is read from each emulator's own request counter.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from prefix_sidecar import _core
from prefix_sidecar.routing import router_settings as router_module
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.v1 import router_pb2
from tests.server.conftest import (
    collect,
    owner_ring,
    requests_per_pod,
    running_sidecar,
    sidecar_config,
    wait_serving,
)


def prefix_text(i: int) -> str:
    return f"Rulebook #{i}: commission tables, banned words, stacking priorities. " * 40


async def test_complete_goes_to_the_contract_owner_and_that_pod_serves(
    sidecar: Sidecar, stub: Any, pods: list[str]
) -> None:
    ring = owner_ring(pods)
    owners = set()
    for i in range(12):
        text = prefix_text(i)
        prefix = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name=f"p{i}", text=text)
        )
        key = _core.route_key(text.encode())
        expected = ring.owner(key)
        assert ring.pick(key, [0] * len(pods), 1, 1.25) == (expected, "home")
        owners.add(expected)
        assert prefix.route_key == key
        assert list(prefix.backends) == [expected]

        route = await stub.Route(router_pb2.RouteRequest(prefix_id=prefix.id))
        assert (route.backend, route.branch, route.route_key) == (expected, "home", key)
        assert list(route.preference) == ring.preference(key, len(pods))

        before = await requests_per_pod(pods)
        chunks = await collect(
            stub.Complete(router_pb2.CompleteRequest(prefix_name=f"p{i}", input="hi", max_tokens=2))
        )
        after = await requests_per_pod(pods)
        assert chunks[0].backend == expected
        served = [url for url in pods if after[url] != before[url]]
        assert served == [expected], f"prefix {i}: owner {expected}, served by {served}"
    assert len(owners) > 1, "12 prefixes over 3 pods all on one pod: the test proves little"


async def test_prompt_starting_with_a_registered_prefix_routes_as_that_prefix(
    sidecar: Sidecar, stub: Any, pods: list[str]
) -> None:
    text = prefix_text(99)
    prefix = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="rules", text=text))
    for question in ("Q: can I stack coupons?", "Q: " + "x" * 10_000):
        reply = await stub.Route(router_pb2.RouteRequest(prompt=text + question))
        assert reply.prefix_id == prefix.id
        assert reply.route_key == prefix.route_key
        assert reply.backend == owner_ring(pods).owner(prefix.route_key)
    # Complete with the whole prompt as input (no prefix field) is routed the same way.
    chunks = await collect(
        stub.Complete(router_pb2.CompleteRequest(input=text + "Q: ok?", max_tokens=1))
    )
    assert chunks[0].backend == owner_ring(pods).owner(prefix.route_key)


async def test_unregistered_prompt_routes_on_its_first_window_bytes(
    tmp_path: Path, pods: list[str]
) -> None:
    ring = owner_ring(pods)
    head = "é" * 3000  # 6000 UTF-8 bytes: the 4096-byte window ends inside the head
    backends = set()
    window = sidecar_config(tmp_path, pods, unregistered_routing="window")  # v1's route
    async with running_sidecar(window) as (_, stub):
        for i in range(8):
            shared = f"{i}:" + head
            replies = [
                await stub.Route(router_pb2.RouteRequest(prompt=shared + tail))
                for tail in ("A", "B" * 500)
            ]
            key = _core.route_key(shared.encode()[:4096])
            for reply in replies:
                assert reply.prefix_id == ""
                assert reply.route_key == key
                assert reply.backend == ring.owner(key)
            backends.add(replies[0].backend)
        short = await stub.Route(router_pb2.RouteRequest(prompt="short prompt"))
    assert short.route_key == _core.route_key(b"short prompt")
    assert len(backends) > 1


async def test_the_route_window_is_the_routers_constant(
    tmp_path: Path, pods: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(router_module, "ROUTE_WINDOW_BYTES", 16)  # read when the sidecar starts
    config = sidecar_config(tmp_path, pods)
    async with running_sidecar(config) as (_, stub):
        prompt = "0123456789abcdef" + "different tails do not matter"
        reply = await stub.Route(router_pb2.RouteRequest(prompt=prompt))
        other = await stub.Route(router_pb2.RouteRequest(prompt=prompt[:16] + "zzz"))
    assert reply.route_key == other.route_key == _core.route_key(b"0123456789abcdef")
    assert reply.backend == owner_ring(pods).owner(reply.route_key)


async def test_replicas_give_a_replica_set_in_ring_order(
    sidecar: Sidecar, stub: Any, pods: list[str]
) -> None:
    text = prefix_text(7)
    prefix = await stub.RegisterPrefix(
        router_pb2.RegisterPrefixRequest(name="hot", text=text, replicas=2)
    )
    assert prefix.replicas == 2
    assert list(prefix.backends) == owner_ring(pods).preference(prefix.route_key, 2)


async def test_sidecars_agree_whatever_the_spelling_and_order_of_the_pod_urls(
    tmp_path: Path, pods: list[str]
) -> None:
    """Routing hashes canonical urls: 'HTTP://127.0.0.1:P/' and '127.0.0.1:P' are one pod."""
    respelled = [pods[2].upper() + "/", pods[0].removeprefix("http://"), pods[1]]
    prompts = [f"merchant {i}: coupon stacking question" for i in range(300)]
    answers = []
    for name, backends in (("a", pods), ("b", respelled)):
        config = sidecar_config(tmp_path, backends, listen=f"unix://{tmp_path}/{name}.sock")
        async with running_sidecar(config, wait=False) as (_, stub):
            await wait_serving(stub, pods)
            replies = [await stub.Route(router_pb2.RouteRequest(prompt=p)) for p in prompts]
            answers.append([r.backend for r in replies])
    assert answers[0] == answers[1]
    ring = owner_ring(pods)
    assert answers[0] == [ring.owner(_core.route_key(p.encode())) for p in prompts]


async def test_weights_scale_a_pods_share_as_the_contract_says(
    tmp_path: Path, pods: list[str]
) -> None:
    weights = {pods[0]: 3, pods[1]: 1, pods[2]: 1}
    backends = tmp_path / "backends.json"
    backends.write_text(
        json.dumps([{"url": url, "weight": w} for url, w in weights.items()]), encoding="utf-8"
    )
    prompts = [f"tenant {i}: rules" for i in range(2000)]
    config = sidecar_config(tmp_path, [], backends_file=str(backends))
    async with running_sidecar(config) as (_, stub):
        await wait_serving(stub, pods)
        listed = await stub.ListBackends(router_pb2.ListBackendsRequest())
        replies = []
        for start in range(0, len(prompts), 500):
            replies += await asyncio.gather(
                *(
                    stub.Route(router_pb2.RouteRequest(prompt=p))
                    for p in prompts[start : start + 500]
                )
            )
    assert {b.url: b.weight for b in listed.backends} == weights
    urls = sorted(pods)
    ring = _core.Ring(urls, [weights[u] for u in urls])
    got = [r.backend for r in replies]
    assert got == [ring.owner(_core.route_key(p.encode())) for p in prompts]
    assert got.count(pods[0]) > 2 * got.count(pods[1])  # 3/5 of the keys vs 1/5
