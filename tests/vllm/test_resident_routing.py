"""Routing on residency against real vLLM pods (issue 29, its first target): a registered
prefix with two homes, its next pod flooded straight (not through the sidecar) until vLLM
evicts it, then its next pod restarted; after each, the sidecar's next request for it is
served cached, by the home that still holds it after the flood, and the flooded pod is
re-prewarmed once."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.vllm.fleet import VllmFleet
from prefix_sidecar_tools.vllm.tiny_model import document
from tests.kv_events.publisher import reprewarms
from tests.server.conftest import wait_for, wait_serving
from tests.vllm.conftest import KV_BLOCK as BLOCK
from tests.vllm.conftest import VLLM_TESTS, complete_usage, kv_events_fleet, kv_sidecar

pytestmark = VLLM_TESTS

PODS = 4
FLOOD_TOKENS = 1000


@pytest_asyncio.fixture(scope="module", loop_scope="package")
async def kv_fleet() -> AsyncIterator[VllmFleet]:
    async with kv_events_fleet(PODS) as fleet:
        yield fleet


async def flood(session: aiohttp.ClientSession, url: str, model: str, seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(10, 4000) for _ in range(FLOOD_TOKENS)]
    body = {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0}
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        assert reply.status == 200, await reply.text()


def sample(sidecar: Sidecar, name: str, backend: str, outcome: str) -> float:
    label = "result" if name == "prefix_sidecar_prewarm_total" else "outcome"
    value = sidecar.metrics.registry.get_sample_value(name, {"backend": backend, label: outcome})
    return value or 0.0


@pytest.mark.timeout(900)  # four pods and a restart on two busy cores
async def test_a_lost_home_routes_to_the_replica_that_holds_it(
    kv_fleet: VllmFleet, tmp_path: Path
) -> None:
    async with kv_sidecar(tmp_path, kv_fleet) as (sidecar, stub, session):
        request = router_pb2.RegisterPrefixRequest(
            name="resroute", text=document("resroute", 700), replicas=2, prewarm=True
        )
        registered = await stub.RegisterPrefix(request, timeout=120)
        entry = sidecar.pools.default.store.get(registered.id)
        homes = sidecar.pools.default.router.home_set(entry)
        assert len(homes) == 2
        await wait_for(
            lambda: sidecar.pools.default.residency.resident(registered.id) == sorted(homes), 30
        )
        tokens = sidecar.pools.default.store.get(registered.id).tokens
        whole = tokens // BLOCK * BLOCK
        assert whole >= 4 * BLOCK

        async def next_pod() -> str:
            reply = await stub.Route(router_pb2.RouteRequest(prefix_id=registered.id))
            return str(reply.backend)

        # 1. Flood the next pod straight until vLLM evicted the prefix there.
        flooded = await next_pod()
        started = time.monotonic()
        for seed in range(40):
            await flood(session, flooded, kv_fleet.model, seed)
            if sidecar.pools.default.residency.holds(flooded, registered.id) is False:
                break
        assert sidecar.pools.default.residency.holds(flooded, registered.id) is False, (
            "never evicted"
        )
        flood_s = time.monotonic() - started
        assert await next_pod() != flooded
        served, usage = await complete_usage(stub, registered.id, " Question: after the flood?")
        after_flood = usage["prompt_tokens_details"]["cached_tokens"]
        assert served != flooded and after_flood >= 0.9 * whole, (served, usage)
        flood_served = served
        # The flooded pod is re-prewarmed, once, and holds the prefix again.
        started = time.monotonic()
        await wait_for(
            lambda: sidecar.pools.default.residency.holds(flooded, registered.id) is True, 30
        )
        back_s = time.monotonic() - started
        back_resident = sidecar.pools.default.residency.holds(flooded, registered.id)
        sent = reprewarms(sidecar, "evicted")
        assert sent == 1

        # 2. Restart the pod it would route to next.
        restarted = await next_pod()
        index = kv_fleet.urls.index(restarted)
        warmed_before = sample(sidecar, "prefix_sidecar_prewarm_total", restarted, "warmed")
        await kv_fleet.kill(index)
        await wait_for(
            lambda: not sidecar.pools.default.residency.known(restarted), 30, "the pod unknown"
        )
        await kv_fleet.restart(index)
        await wait_serving(stub, kv_fleet.urls, timeout=60)
        # Warmed before it served (warm_before_serve); unknown until the subscriber found its
        # source again and it published a batch, so the hash's pick stands.
        served, usage = await complete_usage(stub, registered.id, " Question: after restart?")
        after_restart = usage["prompt_tokens_details"]["cached_tokens"]
        assert after_restart >= 0.9 * whole, (served, restarted, usage)
        restart_served = served
        warmed = sample(sidecar, "prefix_sidecar_prewarm_total", restarted, "warmed")
        assert warmed == warmed_before + 1
        if served != restarted:
            await flood(session, restarted, kv_fleet.model, 1000)  # one batch from it
        await asyncio.sleep(2)
        holds_after = sidecar.pools.default.residency.holds(restarted, registered.id)
        outcomes = {
            outcome: sample(sidecar, "prefix_sidecar_kv_events_total", restarted, outcome)
            for outcome in ("start", "restart", "replayed", "gap", "disconnected", "no_source")
        }
    print(
        f"\nprefix {whole} tokens in whole blocks; after a {flood_s:.1f} s flood: "
        f"{after_flood} cached (on {flood_served}, flooded {flooded}), re-prewarms sent: "
        f"{sent:.0f}, resident there again {back_s:.1f} s later: {back_resident}; after a "
        f"restart: {after_restart} cached (on {restart_served}, restarted {restarted}); the "
        f"restarted pod's residency 2 s after a batch from it: {holds_after}, {outcomes}"
    )
