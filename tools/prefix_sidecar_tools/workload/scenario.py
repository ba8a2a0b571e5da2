"""One policy's run on a shared fleet: start its sidecar(s), register, prewarm, replay, stop.

The demo and the fleet bench both call `run_policy` once per routing policy on the SAME
fleet and the SAME trace. Every run starts from the same state: pod caches reset, then
every prefix prewarmed on its replica set (the ring's home set does not depend on the
policy), so the only difference between runs is where each request is sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.emulator import get_stats, reset_cache
from prefix_sidecar_tools.harness import SidecarProcesses
from prefix_sidecar_tools.workload.driver import (
    CHANNEL_OPTIONS,
    Outcome,
    RequestFactory,
    drive,
    thin_requests,
)
from prefix_sidecar_tools.workload.trace import Arrival, PrefixDef

PrewarmCallback = Callable[[str, router_pb2.PrewarmEvent], None]


@dataclass
class PolicyRun:
    policy: str
    sidecars: int
    outcomes: list[Outcome]
    prefix_ids: list[str]
    home_sets: dict[str, list[str]]
    pod_requests: dict[str, int]  # requests each pod received after the warm-up
    prewarm: list[router_pb2.PrewarmEvent] = field(default_factory=list)
    wall_s: float = 0.0


async def reset_fleet(urls: Sequence[str]) -> None:
    await asyncio.gather(*(reset_cache(url) for url in urls))


async def pod_request_counts(urls: Sequence[str]) -> dict[str, int]:
    stats = await asyncio.gather(*(get_stats(url) for url in urls))
    return {url: int(s["requests"]) for url, s in zip(urls, stats, strict=True)}


async def register_all(
    targets: Sequence[str], prefixes: Sequence[PrefixDef], replicas: Sequence[int]
) -> tuple[list[str], dict[str, list[str]]]:
    """Register every prefix on every sidecar (each keeps its own store); ids and home sets.

    Home sets are read back once all are registered: with a KV budget a prefix's home can
    depend on the prefixes registered after it."""
    ids: list[str] = []
    homes: dict[str, list[str]] = {}
    for target in targets:
        async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            ids = []
            for prefix, count in zip(prefixes, replicas, strict=True):
                reply = await stub.RegisterPrefix(
                    router_pb2.RegisterPrefixRequest(
                        name=prefix.name, text=prefix.text, replicas=count
                    ),
                    timeout=30,
                )
                ids.append(reply.id)
            listed = await stub.ListPrefixes(router_pb2.ListPrefixesRequest(), timeout=30)
            homes = {p.name: list(p.backends) for p in listed.prefixes}
    return ids, homes


async def prewarm_all(
    target: str, prefix_ids: Sequence[str], names: Sequence[str], on_event: PrewarmCallback | None
) -> list[router_pb2.PrewarmEvent]:
    """Prewarm every prefix on its replica set, all at once; events as they arrive."""
    events: list[router_pb2.PrewarmEvent] = []
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def one(prefix_id: str, name: str) -> None:
            async for event in stub.Prewarm(
                router_pb2.PrewarmRequest(prefix_id=prefix_id), timeout=300
            ):
                events.append(event)
                if on_event is not None:
                    on_event(name, event)

        await asyncio.gather(*(one(i, n) for i, n in zip(prefix_ids, names, strict=True)))
    return events


async def route_timings(target: str, prefix_id: str, calls: int) -> dict[str, list[float]]:
    """`calls` Route RPCs: the sidecar's own decision_ns and the caller's round trip (ns)."""
    decision: list[float] = []
    round_trip: list[float] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.RouteRequest(prefix_id=prefix_id)
        for _ in range(calls):
            started = time.perf_counter_ns()
            reply = await stub.Route(request)
            round_trip.append(float(time.perf_counter_ns() - started))
            decision.append(float(reply.decision_ns))
    return {"decision_ns": decision, "round_trip_ns": round_trip}


async def run_policy(
    urls: Sequence[str],
    policy: str,
    prefixes: Sequence[PrefixDef],
    replicas: Sequence[int],
    trace: Sequence[Arrival],
    *,
    time_scale: float,
    max_tokens: int,
    first_token_timeout_s: float,
    warmup_s: float = 0.0,
    sidecars: int = 1,
    settings: Mapping[str, object] | None = None,
    on_prewarm: PrewarmCallback | None = None,
    before_stop: Callable[[SidecarProcesses, list[str]], Any] | None = None,
    requests: Callable[[list[str]], RequestFactory] | None = None,
) -> PolicyRun:
    """Reset caches, start `sidecars` processes with `policy`, prewarm, replay the trace.

    `warmup_s` (modelled) splits the trace: the pods' request counters are read when the
    warm-up ends, so `pod_requests` covers only the measured part. `requests(prefix_ids)`
    makes each arrival's request (default: its prefix's id and its thin query).
    """
    started = time.perf_counter()
    await reset_fleet(urls)
    async with SidecarProcesses(sidecars, urls, policy, settings) as processes:
        ids, homes = await register_all(processes.targets, prefixes, replicas)
        events = await prewarm_all(
            processes.targets[0], ids, [p.name for p in prefixes], on_prewarm
        )
        counts: dict[str, dict[str, int]] = {}
        if warmup_s <= 0:
            # Before the first request: read beside the trace's start, the counters could
            # already hold its first request (the demo counted 59 of 60 in CI).
            counts["start"] = await pod_request_counts(urls)

        async def snapshot_after_warmup() -> None:
            if warmup_s > 0:
                await asyncio.sleep(warmup_s / time_scale)
                counts["start"] = await pod_request_counts(urls)

        snapshot = asyncio.create_task(snapshot_after_warmup())
        try:
            outcomes = await drive(
                processes.targets,
                trace,
                requests(ids) if requests is not None else thin_requests(ids, max_tokens),
                time_scale=time_scale,
                first_token_timeout_s=first_token_timeout_s,
            )
        finally:
            if not snapshot.done():
                snapshot.cancel()
        await asyncio.gather(snapshot, return_exceptions=True)
        end = await pod_request_counts(urls)
        begin = counts.get("start", dict.fromkeys(urls, 0))
        if before_stop is not None:
            result = before_stop(processes, ids)
            if asyncio.iscoroutine(result):
                await result
    return PolicyRun(
        policy=policy,
        sidecars=sidecars,
        outcomes=outcomes,
        prefix_ids=ids,
        home_sets=homes,
        pod_requests={url: end[url] - begin[url] for url in urls},
        prewarm=events,
        wall_s=time.perf_counter() - started,
    )
