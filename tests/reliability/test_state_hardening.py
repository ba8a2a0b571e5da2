"""State that must not grow or go stale (issue 11, items 9, 11 and 12): metric series of pods
that left and of names no longer registered, a text registered under two names, prewarms
that end after an unregister, and a wedged pod next to a healthy joiner.

Everything is real: `prefix-sidecar serve` as a process or the real `Sidecar`, emulator pods
as processes, small aiohttp pods on 127.0.0.1, a backends file rewritten like a ConfigMap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet
from tests.fake_pod import StartPod, ok_stream, sse_ok, text_event
from tests.server.conftest import cli_sidecar, free_port, running_sidecar, sidecar_config

# Series labelled by pod (prefix_sidecar_home_prefix_tokens is computed at scrape time from
# the current ring, so it is bounded by construction).
PER_BACKEND = (
    "prefix_sidecar_requests",
    "prefix_sidecar_failovers",
    "prefix_sidecar_ttft_seconds",
    "prefix_sidecar_in_flight",
    "prefix_sidecar_backend_healthy",
    "prefix_sidecar_backend_state",
    "prefix_sidecar_prewarm",
)
PER_PREFIX = (
    "prefix_sidecar_prompt_tokens",
    "prefix_sidecar_cached_tokens",
    "prefix_sidecar_completion_tokens",
)


def write_backends(path: Path, urls: list[str]) -> None:
    """Replace the file in one rename, as a ConfigMap update does."""
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps({"backends": urls}), encoding="utf-8")
    staging.replace(path)


async def scrape(port: int) -> tuple[int, dict[str, set[str]]]:
    """(sample lines, metric family -> the values of its backend or prefix label)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        assert response.status == 200
        text = await response.text()
    lines = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key in ("backend", "prefix"):
                if key in sample.labels:
                    labels.setdefault(family.name, set()).add(sample.labels[key])
    return lines, labels


async def in_flight_values(port: int) -> dict[str, float]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    return {
        sample.labels["backend"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "prefix_sidecar_in_flight"
        for sample in family.samples
    }


async def overloaded(_: web.Request) -> web.Response:
    return web.Response(status=503, text="overloaded")


class PodPorts:
    """Many pods from two aiohttp apps (one answers, one is overloaded: 503, so requests
    fail over from it): each pod is a listening socket on its own port of 127.0.0.1, so a
    "new pod IP" is a new URL, as after a rollout."""

    def __init__(self) -> None:
        self.runners = {True: self._runner(ok_stream), False: self._runner(overloaded)}
        self.sites: dict[str, web.SockSite] = {}

    @staticmethod
    def _runner(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.AppRunner:
        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", handler)
        return web.AppRunner(app, access_log=None, shutdown_timeout=0.5)

    async def __aenter__(self) -> PodPorts:
        for runner in self.runners.values():
            await runner.setup()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for runner in self.runners.values():
            await runner.cleanup()

    async def open(self, count: int, answering: bool = True) -> list[str]:
        urls = []
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            site = web.SockSite(self.runners[answering], sock)
            await site.start()
            self.sites[url] = site
            urls.append(url)
        return urls

    async def rollout(self, count: int) -> list[str]:
        """A new generation of pods: 2 overloaded, 1 dead (connections refused), the rest
        answering."""
        return [*await self.open(count - 3), *await self.open(2, answering=False), dead_url()]

    async def close(self, urls: list[str]) -> None:
        for url in urls:
            if url in self.sites:
                await self.sites.pop(url).stop()


def dead_url() -> str:
    """A pod that left without a trace: its port refuses connections."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.mark.slow
async def test_metric_series_stay_bounded_under_name_and_pod_churn(tmp_path: Path) -> None:
    """10,000 names registered and unregistered (every 5th used by a Complete: 2,000 names
    with token series), and 1,000 pod URLs (a backends file rewritten 50 times with 20 new
    pods: 17 answering, 2 overloaded, 1 dead), through a `prefix-sidecar serve` process: the
    scrape only ever names the current pods and registered names, and its size does not
    grow with the churn (before the fix: from 678 to 28,238 lines)."""
    rounds, pods_per_round, names_per_round = 50, 20, 200
    backends = tmp_path / "backends.json"
    metrics_port = free_port()
    args = ["--backends-file", str(backends), "--set", f"metrics_port={metrics_port}"]
    for field, value in (
        ("file_interval_s", 0.02),
        ("health_interval_s", 0.2),
        ("health_timeout_s", 0.5),
        ("connect_timeout_s", 0.5),
    ):
        args += ["--set", f"{field}={value}"]
    sizes, failed_over = [], 0
    async with PodPorts() as pods:
        current = await pods.rollout(pods_per_round)
        write_backends(backends, current)
        async with (
            cli_sidecar(tmp_path, args, name="churn") as process,
            grpc.aio.insecure_channel(process.target) as channel,
        ):
            stub = router_pb2_grpc.RouterStub(channel)
            for round_number in range(rounds):
                await _adopted(stub, current)
                names = [f"rules-{round_number}-{i}" for i in range(names_per_round)]
                await asyncio.gather(
                    *(
                        stub.RegisterPrefix(
                            router_pb2.RegisterPrefixRequest(name=name, text=f"{name}: no " * 40)
                        )
                        for name in names
                    )
                )
                used = names[::5]
                await asyncio.gather(*(_complete(stub, name) for name in used))
                lines, labels = await scrape(metrics_port)
                # Mid-round: the series of exactly these names and these pods.
                assert labels["prefix_sidecar_prompt_tokens"] == set(used)
                for family in PER_BACKEND:
                    assert labels.get(family, set()) <= {*current, "-"}, family
                failed_over += len(labels.get("prefix_sidecar_failovers", ()))
                await asyncio.gather(
                    *(
                        stub.UnregisterPrefix(router_pb2.UnregisterPrefixRequest(prefix_name=n))
                        for n in names
                    )
                )
                sizes.append(lines)
                # The rollout: every pod of this round leaves, 20 new ones come.
                gone, current = current, await pods.rollout(pods_per_round)
                write_backends(backends, current)
                await _adopted(stub, current)
                await pods.close(gone)
            lines, labels = await scrape(metrics_port)
    assert failed_over, "no failover series: the churn missed a kind of series"
    for family in PER_PREFIX:
        assert labels.get(family, set()) <= {"-"}, (family, sorted(labels[family])[:5])
    for family in PER_BACKEND:
        assert labels.get(family, set()) <= {*current, "-"}, (family, len(labels[family]))
    # Independent of the churn: the last rounds' scrapes are no bigger than the first ones'.
    assert max(sizes[-5:]) <= max(sizes[:5]) * 1.25, sizes
    assert lines <= max(sizes[:5]), (lines, sizes)


async def _adopted(stub: Any, urls: list[str], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        reply = await stub.ListBackends(router_pb2.ListBackendsRequest())
        if sorted(b.url for b in reply.backends) == sorted(urls):
            return
        assert time.monotonic() < deadline, "the sidecar did not adopt the new backends file"
        await asyncio.sleep(0.01)


async def _complete(stub: Any, name: str) -> None:
    call = stub.Complete(router_pb2.CompleteRequest(prefix_name=name, input="q", max_tokens=1))
    chunks = [chunk async for chunk in call]
    assert chunks[-1].usage.prompt_tokens == 3


async def test_a_stream_on_a_departed_pod_leaves_no_series(
    tmp_path: Path, fake_pod: StartPod
) -> None:
    """A pod leaves while a stream on it still runs: its in_flight stays 1 until the stream
    ends, never goes to -1, and then every series naming the pod is gone."""
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(text_event("one"))
        await release.wait()
        await response.write(sse_ok("two"))
        await response.write_eof()
        return response

    leaving, staying = await fake_pod(slow), await fake_pod()
    backends = tmp_path / "backends.json"
    write_backends(backends, [leaving.url])
    port = free_port()
    config = sidecar_config(tmp_path, [], backends_file=str(backends), metrics_port=port)
    async with running_sidecar(config) as (_, stub):
        await _adopted(stub, [leaving.url])
        call = stub.Complete(router_pb2.CompleteRequest(input="hello", max_tokens=4))
        first = await call.read()
        assert first.backend == leaving.url
        write_backends(backends, [staying.url])
        await _adopted(stub, [staying.url])
        assert (await in_flight_values(port)).get(leaving.url) == 1
        release.set()
        while (chunk := await call.read()) is not grpc.aio.EOF:
            last = chunk
        assert last.usage.prompt_tokens == 3
        _, labels = await scrape(port)
        values = await in_flight_values(port)
    assert leaving.url not in values, values
    for family, named in labels.items():
        assert leaving.url not in named, family


async def test_a_text_under_two_names_is_listed_and_labelled_by_name(
    tmp_path: Path, fake_pod: StartPod
) -> None:
    """ "a" and "b" name one text: both are listed with their versions, usage by "b" is
    labelled "b", and after "a" is unregistered the text is "b"'s (listed, and usage by id
    is labelled "b"), and "a"'s series are gone."""
    pod = await fake_pod()
    port = free_port()
    async with running_sidecar(sidecar_config(tmp_path, [pod.url], metrics_port=port)) as (
        _,
        stub,
    ):
        text = "shared rules: no fake countdowns. " * 50
        a = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="a", text=text))
        b = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="b", text=text))
        assert a.id == b.id
        assert (b.name, list(b.versions)) == ("b", [b.id])
        listed = await stub.ListPrefixes(router_pb2.ListPrefixesRequest())
        assert [(p.name, p.id, list(p.versions)) for p in listed.prefixes] == [
            ("a", a.id, [a.id]),
            ("b", b.id, [b.id]),
        ]
        await _complete(stub, "a")
        await _complete(stub, "b")
        _, labels = await scrape(port)
        assert labels["prefix_sidecar_prompt_tokens"] == {"a", "b"}

        reply = await stub.UnregisterPrefix(router_pb2.UnregisterPrefixRequest(prefix_name="a"))
        assert list(reply.removed_ids) == []  # "b" still holds the text
        listed = await stub.ListPrefixes(router_pb2.ListPrefixesRequest())
        assert [(p.name, p.id, list(p.versions)) for p in listed.prefixes] == [("b", b.id, [b.id])]
        call = stub.Complete(router_pb2.CompleteRequest(prefix_id=b.id, input="q", max_tokens=1))
        assert [chunk async for chunk in call][-1].usage.prompt_tokens == 3
        _, labels = await scrape(port)
        assert labels["prefix_sidecar_prompt_tokens"] == {"b"}
        # Asked by the old name: NOT_FOUND, not the text under its other name.
        try:
            await stub.Route(router_pb2.RouteRequest(prefix_name="a"))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND
        else:
            raise AssertionError("the unregistered name still resolves")


async def test_a_prewarm_ending_after_unregister_leaves_no_stale_warm_prefix(
    tmp_path: Path, fake_pod: StartPod
) -> None:
    """Prewarm (the RPC) and warm-before-serve (a joining pod) both finish after the prefix
    was unregistered: ListBackends must not list it as warm on any pod."""
    gate = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        await gate.wait()
        return await ok_stream(request)

    pod, joiner = await fake_pod(held), await fake_pod(held)
    backends = tmp_path / "backends.json"
    write_backends(backends, [pod.url])
    config = sidecar_config(tmp_path, [], backends_file=str(backends), health_interval_s=0.1)
    async with running_sidecar(config) as (_, stub):
        await _wait_state(stub, pod.url, "serving")
        prefix = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name="rules", text="rules " * 100, replicas=2)
        )
        prewarm = stub.Prewarm(router_pb2.PrewarmRequest(prefix_id=prefix.id))
        assert (await prewarm.read()).state == router_pb2.PrewarmEvent.STARTED
        write_backends(backends, [pod.url, joiner.url])
        await _wait_state(stub, joiner.url, "warming")
        while not joiner.bodies:  # its warm-before-serve prewarm reached it
            await asyncio.sleep(0.01)
        await stub.UnregisterPrefix(router_pb2.UnregisterPrefixRequest(prefix_id=prefix.id))
        gate.set()
        while (event := await prewarm.read()) is not grpc.aio.EOF:
            last = event
        assert last.state == router_pb2.PrewarmEvent.WARMED
        await _wait_state(stub, joiner.url, "serving")
        reply = await stub.ListBackends(router_pb2.ListBackendsRequest())
    assert {b.url: list(b.warm_prefixes) for b in reply.backends} == {
        pod.url: [],
        joiner.url: [],
    }


async def _wait_state(stub: Any, url: str, state: str, timeout: float = 5.0) -> float:
    """Wait until the pod shows `state`; returns the monotonic time it was seen."""
    deadline = time.monotonic() + timeout
    while True:
        reply = await stub.ListBackends(router_pb2.ListBackendsRequest())
        if {b.url: b.state for b in reply.backends}.get(url) == state:
            return time.monotonic()
        assert time.monotonic() < deadline, f"{url} never became {state}: {reply}"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def fleets() -> AsyncIterator[tuple[str, str, str]]:
    """(a serving pod, a wedged pod: /health OK, completions stall an hour, a healthy pod),
    each an emulator process."""
    fast = EmulatorConfig(time_scale=1000.0)
    wedged = EmulatorConfig(time_scale=1000.0)
    wedged.faults.stall_seconds = 3600.0
    async with EmulatorFleet(2, fast) as good, EmulatorFleet(1, wedged) as bad:
        yield good.urls[0], bad.urls[0], good.urls[1]


async def test_a_wedged_pod_does_not_hold_back_a_healthy_joiner(tmp_path: Path) -> None:
    """A wedged pod joins with 8 prefixes to warm (more than prewarm.CONCURRENCY, 4 in flight
    per pod), then a healthy pod joins: the healthy one serves within its own warm time + 2 s
    instead of waiting for the wedged pod's timeouts (10 s and more before the fix)."""
    async with fleets() as (base, wedged, healthy):
        backends = tmp_path / "backends.json"
        write_backends(backends, [base])
        config = sidecar_config(
            tmp_path,
            [],
            backends_file=str(backends),
            replicas=3,  # every prefix is home on every pod: 8 pairs per joiner
            health_interval_s=0.1,
        )
        async with running_sidecar(config) as (_, stub):
            await _wait_state(stub, base, "serving")
            for i in range(8):
                await stub.RegisterPrefix(
                    router_pb2.RegisterPrefixRequest(name=f"p{i}", text=f"prefix {i}. " * 400)
                )
            write_backends(backends, [base, wedged])
            await _wait_state(stub, wedged, "warming")
            await asyncio.sleep(0.3)  # its 8 prewarms are hanging now
            joined = time.monotonic()
            write_backends(backends, [base, wedged, healthy])
            served = await _wait_state(stub, healthy, "serving", timeout=12.0)
            states = {
                b.url: (b.state, len(b.warm_prefixes))
                for b in (await stub.ListBackends(router_pb2.ListBackendsRequest())).backends
            }
    # Its own warm time: file poll + health check + 8 fast prewarms, well under a second.
    assert served - joined < 2.5, f"the healthy joiner took {served - joined:.1f} s"
    assert states[healthy] == ("serving", 8)
    assert states[wedged] == ("warming", 0)
