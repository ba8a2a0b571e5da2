"""Membership from a backends file and from DNS, and warm before serve for a joining pod."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from prefix_sidecar import _core
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.emulator import EmulatorConfig, get_stats, run_emulator, set_faults
from tests.membership.conftest import DnsFixture, EditableResolver

from .conftest import (
    FAST,
    backend_states,
    cli_sidecar,
    collect,
    owner_ring,
    running_sidecar,
    sidecar_config,
    wait_for,
    wait_serving,
)

PROMPTS = [f"merchant {i}: set up a 2-for-15%-off script for item {i}" for i in range(200)]


async def routes(stub: Any) -> list[str]:
    replies = await asyncio.gather(
        *(stub.Route(router_pb2.RouteRequest(prompt=p)) for p in PROMPTS)
    )
    return [r.backend for r in replies]


def expected_routes(urls: list[str]) -> list[str]:
    ring = owner_ring(urls)
    return [ring.owner(_core.route_key(p.encode())) for p in PROMPTS]


def write_backends(path: Path, urls: list[str]) -> None:
    """Replace the file in one rename, as a ConfigMap update does (no half-written reads)."""
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps({"backends": urls}), encoding="utf-8")
    staging.replace(path)


async def test_backends_file_changes_are_followed(tmp_path: Path, pods: list[str]) -> None:
    backends = tmp_path / "backends.json"
    write_backends(backends, pods[:2])
    config = sidecar_config(tmp_path, [], backends_file=str(backends))
    async with running_sidecar(config) as (_, stub):
        for members in (pods[:2], pods, [pods[0], pods[2]]):
            write_backends(backends, members)
            await wait_serving(stub, members)
            assert await routes(stub) == expected_routes(members)
        # A broken file keeps the last good membership instead of dropping every pod.
        backends.write_text("backends: [", encoding="utf-8")
        await asyncio.sleep(0.3)
        assert sorted(await backend_states(stub)) == sorted([pods[0], pods[2]])
        assert await routes(stub) == expected_routes([pods[0], pods[2]])


@pytest.fixture
def dns_server() -> Iterator[DnsFixture]:
    """A real DNS server (dnslib, UDP on 127.0.0.1) whose records the test edits; the
    membership engineer's helper from tests/membership."""
    fixture = DnsFixture(EditableResolver(), port=0)
    fixture.start()
    yield fixture
    fixture.stop()


async def test_dns_membership_follows_the_records(tmp_path: Path, dns_server: DnsFixture) -> None:
    name = "vllm-headless.llm.svc.cluster.local"
    # A headless Service: one A record per pod, all on the same port. Loopback aliases
    # 127.0.0.2-4 give three real pods with three IPs and one port.
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(run_emulator(FAST, port=0, host="127.0.0.2"))
        port = int(first.rsplit(":", 1)[1])
        urls = [first] + [
            await stack.enter_async_context(run_emulator(FAST, port=port, host=f"127.0.0.{i}"))
            for i in (3, 4)
        ]
        dns_server.resolver.set(name, ["127.0.0.2", "127.0.0.3"])
        sidecar = await stack.enter_async_context(
            cli_sidecar(
                tmp_path,
                [
                    "--backends-dns",
                    f"{name}:{port}",
                    "--set",
                    f"dns_nameserver=127.0.0.1:{dns_server.port}",
                    "--set",
                    "dns_interval_s=0.2",
                    "--set",
                    "health_interval_s=0.5",
                ],
            )
        )
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(sidecar.target))
        stub = router_pb2_grpc.RouterStub(channel)
        for ips in (["127.0.0.2", "127.0.0.3"], ["127.0.0.4", "127.0.0.2", "127.0.0.3"]):
            dns_server.resolver.set(name, ips)
            members = [f"http://{ip}:{port}" for ip in ips]
            await wait_serving(stub, members)
            assert await routes(stub) == expected_routes(members)
        # Scale down to one pod; then an empty answer (all pods unready) keeps the last good.
        dns_server.resolver.set(name, ["127.0.0.3"])
        await wait_serving(stub, [urls[1]])
        dns_server.resolver.set(name, [])
        await asyncio.sleep(0.5)
        assert await backend_states(stub) == {urls[1]: "serving"}
        assert set(await routes(stub)) == {urls[1]}
        assert dns_server.resolver.queries > 4


def owned_by(urls: list[str], owner: str, count: int, tag: str) -> list[str]:
    """`count` prefix texts whose contract owner over `urls` is `owner`."""
    ring = owner_ring(urls)
    found = []
    for i in range(100_000):
        text = f"[{tag} {i}] platform rules, commission tables, banned words. " * 60
        if ring.owner(_core.route_key(text.encode())) == owner:
            found.append(text)
            if len(found) == count:
                return found
    raise AssertionError("not enough prefixes")  # pragma: no cover


async def test_a_joining_pod_warms_its_home_prefixes_before_it_serves(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(run_emulator(FAST, port=0)) for _ in range(2)]
        joiner = await stack.enter_async_context(run_emulator(FAST, port=0))
        everyone = [*pods, joiner]
        backends = tmp_path / "backends.json"
        write_backends(backends, pods)
        config = sidecar_config(tmp_path, [], backends_file=str(backends))
        _, stub = await stack.enter_async_context(running_sidecar(config))
        await wait_serving(stub, pods)

        home = owned_by(everyone, joiner, 2, "joiner")
        elsewhere = owned_by(everyone, pods[0], 1, "pod0")
        ids = {}
        for i, text in enumerate(home + elsewhere):
            prefix = await stub.RegisterPrefix(
                router_pb2.RegisterPrefixRequest(name=f"p{i}", text=text)
            )
            ids[text] = prefix.id

        # Make the joiner's prewarm take a while, so "warming" is observable.
        await set_faults(joiner, stall_seconds=0.6)
        write_backends(backends, everyone)

        async def warming() -> bool:
            return (await backend_states(stub)).get(joiner) == "warming"

        await wait_for(warming, what="the joiner to show as warming")
        listed = await stub.ListBackends(router_pb2.ListBackendsRequest())
        assert {b.url: b.healthy for b in listed.backends}[joiner] is True
        # While it warms, its home prefixes still go to the serving pods.
        reply = await stub.Route(router_pb2.RouteRequest(prefix_id=ids[home[0]]))
        assert reply.backend in pods

        await wait_serving(stub, everyone, timeout=5.0)
        stats = await get_stats(joiner)
        listed = await stub.ListBackends(router_pb2.ListBackendsRequest())
        await set_faults(joiner, stall_seconds=0)

        # Exactly the home prefixes were prewarmed, before any routed request reached it.
        assert stats["requests"] == len(home)
        tokens = sorted((len(text.encode()) + 3) // 4 for text in home)
        assert sorted(p["prompt_tokens"] for p in stats["prefills"]) == tokens
        assert all(p["cached_tokens"] == 0 for p in stats["prefills"])
        warm = {b.url: set(b.warm_prefixes) for b in listed.backends}[joiner]
        assert warm == {ids[text] for text in home}

        for text in home:
            chunks = await collect(
                stub.Complete(
                    router_pb2.CompleteRequest(prefix_id=ids[text], input="Q?", max_tokens=2)
                )
            )
            assert chunks[0].backend == joiner
            assert chunks[-1].usage.cached_tokens >= len(text.encode()) // 4 - 16


async def test_a_pod_that_comes_back_is_warmed_again(tmp_path: Path, pods: list[str]) -> None:
    config = sidecar_config(tmp_path, pods, health_interval_s=0.2, eject_after_failures=1)
    async with running_sidecar(config) as (_, stub):
        text = owned_by(pods, pods[1], 1, "back")[0]
        prefix = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="r", text=text))
        await set_faults(pods[1], unhealthy=True)

        async def state_is(state: str) -> bool:
            return (await backend_states(stub))[pods[1]] == state

        await wait_for(lambda: state_is("ejected"), what="the pod to be ejected")
        reply = await stub.Route(router_pb2.RouteRequest(prefix_id=prefix.id))
        assert reply.backend != pods[1]
        before = (await get_stats(pods[1]))["requests"]
        await set_faults(pods[1], unhealthy=False)
        await wait_serving(stub, pods)
        stats = await get_stats(pods[1])
    assert stats["requests"] == before + 1, "the returning pod was not prewarmed"
    assert stats["prefills"][-1]["prompt_tokens"] == (len(text.encode()) + 3) // 4


async def test_warm_before_serve_can_be_turned_off(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pod = await stack.enter_async_context(run_emulator(EmulatorConfig(time_scale=1000)))
        joiner = await stack.enter_async_context(run_emulator(EmulatorConfig(time_scale=1000)))
        backends = tmp_path / "backends.json"
        write_backends(backends, [pod])
        config = sidecar_config(tmp_path, [], backends_file=str(backends), warm_before_serve=False)
        _, stub = await stack.enter_async_context(running_sidecar(config))
        await wait_serving(stub, [pod])
        text = owned_by([pod, joiner], joiner, 1, "off")[0]  # would be warmed if it were on
        await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="r", text=text))
        write_backends(backends, [pod, joiner])
        await wait_serving(stub, [pod, joiner])
        assert (await get_stats(joiner))["requests"] == 0
