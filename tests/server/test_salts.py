"""cache_salt through a real sidecar to recording pods on 127.0.0.1: the salt reaches the pod
(the gRPC body gets it, the HTTP body keeps it as written), routing keys the request by it
(routing contract 10), a prefix registered with a salt is prewarmed with it and never
echoes it, and a bad salt is refused saying what to fix."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from prefix_sidecar.routing.scope import Scope, scoped_key
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.harness import free_port
from tests.fake_pod import FakePod, recording_pod
from tests.server.conftest import collect, running_sidecar, sidecar_config

RULES = "Compliance rule: no absolute claims in promotion copy. " * 40
PROMPT = "tenant question " * 600  # longer than the 4 KB window: organic keys


@contextlib.asynccontextmanager
async def salted_fleet(tmp_path: Path) -> AsyncIterator[tuple[Any, str, list[FakePod]]]:
    """Four recording pods, a sidecar with the HTTP front; yields (stub, base URL, pods)."""
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(recording_pod()) for _ in range(4)]
        port = free_port()
        config = sidecar_config(
            tmp_path, [pod.url for pod in pods], openai_listen=f"127.0.0.1:{port}"
        )
        _, stub = await stack.enter_async_context(running_sidecar(config))
        yield stub, f"http://127.0.0.1:{port}", pods


def sent(pods: list[FakePod]) -> list[dict[str, Any]]:
    return [json.loads(body) for pod in pods for body in pod.bodies]


async def test_a_salt_reaches_the_pod_and_keys_the_route(tmp_path: Path) -> None:
    async with salted_fleet(tmp_path) as (stub, base, pods):
        plain = await stub.Route(router_pb2.RouteRequest(prompt=RULES))
        salted = {
            salt: await stub.Route(router_pb2.RouteRequest(prompt=RULES, cache_salt=salt))
            for salt in ("tenant-a", "tenant-b")
        }
        for salt, reply in salted.items():
            assert reply.route_key == scoped_key(plain.route_key, Scope("", salt))
        # The same salt, the same pod: later turns of one tenant meet its cache.
        again = await stub.Route(router_pb2.RouteRequest(prompt=RULES, cache_salt="tenant-a"))
        assert again.backend == salted["tenant-a"].backend
        await collect(stub.Complete(router_pb2.CompleteRequest(input=PROMPT, cache_salt="t-1")))
        user = router_pb2.ChatMessage(role="user", content="hi")
        await collect(stub.Chat(router_pb2.ChatRequest(messages=[user], cache_salt="t-2")))
        await collect(stub.Complete(router_pb2.CompleteRequest(input=PROMPT)))
        salts = sorted(str(body.get("cache_salt")) for body in sent(pods))
        assert salts == ["None", "t-1", "t-2"]  # the pods differ: sorted
        # Over HTTP the body reaches the pod as written, and routes as gRPC's would.
        body = json.dumps({"model": "m", "prompt": RULES, "cache_salt": "tenant-a"}).encode()
        async with aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/completions", data=body) as reply:
                assert reply.status == 200, await reply.text()
                backend = reply.headers["x-prefix-sidecar-backend"]
            assert backend == salted["tenant-a"].backend
            assert body in [b for pod in pods for b in pod.bodies]


async def test_a_prefix_registered_with_a_salt_is_warmed_with_it(tmp_path: Path) -> None:
    async with salted_fleet(tmp_path) as (stub, _, pods):
        plain = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name="rules", text=RULES, prewarm=True)
        )
        salted = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(
                name="rules", text=RULES, cache_salt="tenant-a", prewarm=True
            )
        )
        assert salted.id != plain.id and salted.salted and not plain.salted
        assert salted.route_key == scoped_key(plain.route_key, Scope("", "tenant-a"))
        warmed = [body for body in sent(pods) if body.get("max_tokens") == 1]
        assert sorted(str(body.get("cache_salt")) for body in warmed) == ["None", "tenant-a"]
        listed = await stub.ListPrefixes(router_pb2.ListPrefixesRequest())
        assert "tenant-a" not in str(listed)  # a salt is the tenant's: never shown
        # A salted query of the registered name routes to its salted prefix's pod.
        chunks = await collect(
            stub.Complete(
                router_pb2.CompleteRequest(prefix_name="rules", input="q", cache_salt="tenant-a")
            )
        )
        assert chunks[0].backend == salted.backends[0]


async def test_a_bad_salt_is_refused_saying_what_to_fix(tmp_path: Path) -> None:
    async with salted_fleet(tmp_path) as (stub, base, pods):
        for request in (
            router_pb2.CompleteRequest(input="q", cache_salt="s" * 1025),
            router_pb2.CompleteRequest(input="q", extra_json='{"cache_salt": "t"}'),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(stub.Complete(request))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cache_salt" in (caught.value.details() or "")
        async with aiohttp.ClientSession() as session:
            for salt in ("s" * 1025, 7):
                body = {"model": "m", "prompt": "q", "cache_salt": salt}
                async with session.post(base + "/v1/completions", json=body) as reply:
                    assert reply.status == 400
                    error = (await reply.json())["error"]
                assert error["param"] == "cache_salt", error
        assert not sent(pods)
