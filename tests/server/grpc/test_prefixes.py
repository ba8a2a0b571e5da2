"""RegisterPrefix / UnregisterPrefix / ListPrefixes, and prewarm on registration."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import grpc
import pytest

from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import get_stats
from tests.server.conftest import collect, owner_ring

V1 = "Compliance rules v1: no 'lowest price ever'. " * 200
V2 = "Compliance rules v2: no 'lowest price ever', no fake countdowns. " * 200


async def test_register_is_idempotent_and_ids_are_sha256(sidecar: Sidecar, stub: Any) -> None:
    first = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="rules", text=V1))
    again = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="rules", text=V1))
    assert first.id == again.id == hashlib.sha256(V1.encode()).hexdigest()
    assert first.bytes == len(V1.encode())
    assert list(again.versions) == [first.id]
    listed = await stub.ListPrefixes(router_pb2.ListPrefixesRequest())
    assert [p.id for p in listed.prefixes] == [first.id]


async def test_new_text_makes_a_new_version_and_the_old_id_still_resolves(
    sidecar: Sidecar, stub: Any, pods: list[str]
) -> None:
    old = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="rules", text=V1))
    new = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="rules", text=V2))
    assert new.id != old.id
    assert list(new.versions) == [old.id, new.id]
    by_name = await stub.Route(router_pb2.RouteRequest(prefix_name="rules"))
    assert by_name.prefix_id == new.id
    by_old_id = await stub.Route(router_pb2.RouteRequest(prefix_id=old.id))
    assert by_old_id.prefix_id == old.id
    assert by_old_id.backend == owner_ring(pods).owner(old.route_key)
    # The old version still serves completions (requests already holding its id).
    chunks = await collect(
        stub.Complete(router_pb2.CompleteRequest(prefix_id=old.id, input="q", max_tokens=1))
    )
    assert chunks[-1].usage.prompt_tokens == (len((V1 + "q").encode()) + 3) // 4


async def test_unregister_by_id_and_by_name(sidecar: Sidecar, stub: Any) -> None:
    old = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="rules", text=V1))
    new = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="rules", text=V2))
    other = await stub.RegisterPrefix(
        router_pb2.RegisterPrefixRequest(name="script", text="s" * 99)
    )

    reply = await stub.UnregisterPrefix(router_pb2.UnregisterPrefixRequest(prefix_id=old.id))
    assert list(reply.removed_ids) == [old.id]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Route(router_pb2.RouteRequest(prefix_id=old.id))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    still = await stub.Route(router_pb2.RouteRequest(prefix_name="rules"))
    assert still.prefix_id == new.id

    reply = await stub.UnregisterPrefix(router_pb2.UnregisterPrefixRequest(prefix_name="rules"))
    assert list(reply.removed_ids) == [new.id]
    listed = await stub.ListPrefixes(router_pb2.ListPrefixesRequest())
    assert [p.id for p in listed.prefixes] == [other.id]

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.UnregisterPrefix(router_pb2.UnregisterPrefixRequest(prefix_name="rules"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "rules" in (info.value.details() or "")


async def test_prewarm_on_register_warms_the_home_set(
    sidecar: Sidecar, stub: Any, pods: list[str]
) -> None:
    text = V1 * 3  # ~27k bytes, ~6.8k tokens
    before = {url: s["prefill_tokens"] for url, s in zip(pods, await _stats(pods), strict=True)}
    prefix = await stub.RegisterPrefix(
        router_pb2.RegisterPrefixRequest(name="rules", text=text, replicas=2, prewarm=True)
    )
    home = list(prefix.backends)
    assert home == owner_ring(pods).preference(prefix.route_key, 2)
    finals = [e for e in prefix.prewarm if e.state == router_pb2.PrewarmEvent.WARMED]
    assert sorted(e.backend for e in finals) == sorted(home)
    tokens = (len(text.encode()) + 3) // 4
    assert all(e.prompt_tokens == tokens and e.prefix_id == prefix.id for e in finals)

    stats = dict(zip(pods, await _stats(pods), strict=True))
    for url in pods:
        prefilled = stats[url]["prefill_tokens"] - before[url]
        if url in home:
            assert prefilled >= tokens - 16, f"{url} is home but was not warmed"
        else:
            assert prefilled == 0, f"{url} is not home but was warmed"

    backends = await stub.ListBackends(router_pb2.ListBackendsRequest())
    warm = {b.url for b in backends.backends if prefix.id in b.warm_prefixes}
    assert warm == set(home)

    chunks = await collect(
        stub.Complete(router_pb2.CompleteRequest(prefix_id=prefix.id, input="Q?", max_tokens=3))
    )
    assert chunks[0].backend in home
    assert chunks[-1].usage.cached_tokens >= tokens - 16


async def test_prewarm_rpc_streams_events_for_every_pod(
    sidecar: Sidecar, stub: Any, pods: list[str]
) -> None:
    prefix = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="rules", text=V2))
    events = [
        e
        async for e in stub.Prewarm(
            router_pb2.PrewarmRequest(prefix_name="rules", all_backends=True)
        )
    ]
    states: dict[str, list[int]] = {}
    for event in events:
        states.setdefault(event.backend, []).append(event.state)
    started, warmed = router_pb2.PrewarmEvent.STARTED, router_pb2.PrewarmEvent.WARMED
    assert states == {url: [started, warmed] for url in pods}
    assert all(e.prefix_id == prefix.id for e in events)


async def _stats(pods: list[str]) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(get_stats(url) for url in pods)))
