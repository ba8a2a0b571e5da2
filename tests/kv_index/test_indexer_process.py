"""`prefix-sidecar kv-indexer` as a process, over emulated pods that publish KV events and a
real redis-server: what a pod caches is found in the index by the prompt's token ids, its
eviction is too, and SIGTERM ends it."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
from redis.asyncio import Redis

from prefix_sidecar.kv_events.block_keys import chain
from prefix_sidecar.kv_index.lookup import IndexLookup
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.tokenize import token_ids
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet
from prefix_sidecar_tools.redis_server import RedisServer, indexer_process
from tests.server.conftest import running_sidecar, sidecar_config
from tests.upstream.test_pod_faults import counted

BLOCK = 16
PRECISE = "prefix_sidecar_precise_decisions_total"
QUERIES = "prefix_sidecar_kv_index_queries_total"
POD = EmulatorConfig(time_scale=1000.0, block_size=BLOCK, kv_tokens=64 * BLOCK, kv_events="map")


async def until_matches(lookup: IndexLookup, keys: list[int], wanted: dict[str, int]) -> None:
    loop = asyncio.get_running_loop()
    deadline, found = loop.time() + 15, None
    while loop.time() < deadline:
        found = await lookup.matches(keys)
        if found == wanted:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the index says {found}, not {wanted}")


async def test_the_indexer_follows_every_pod_into_redis(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with EmulatorFleet(2, POD) as fleet, aiohttp.ClientSession() as session:
        command = [sys.executable, "-m", "prefix_sidecar.cli", "kv-indexer", "--redis"]
        # Spelled as an operator might; the index names each pod as the sidecars do.
        spelled = [url.replace("http://", "HTTP://") + "/" for url in fleet.urls]
        command += [redis_server.url, *(f"--backend={url}" for url in spelled)]
        indexer = await asyncio.create_subprocess_exec(*command)
        try:
            prompt = "the rules of the flash sale, and then a question. " * 12  # 9 blocks
            async with UpstreamClient() as client:
                keys = chain(await token_ids(client, fleet.urls[0], prompt), BLOCK)
            lookup = IndexLookup(redis, deadline_s=1.0)
            pod = fleet.urls[0]
            body = {"model": POD.model, "prompt": prompt, "max_tokens": 1}
            async with session.post(f"{pod}/v1/completions", json=body) as answer:
                assert answer.status == 200
            await until_matches(lookup, keys, {pod: len(keys)})

            for seed in range(8):  # straight to the pod: 64 blocks hold about one of these
                body = {"model": POD.model, "prompt": f"flood {seed} " * 120, "max_tokens": 1}
                async with session.post(f"{pod}/v1/completions", json=body) as answer:
                    assert answer.status == 200
            await until_matches(lookup, keys, {})
        finally:
            if indexer.returncode is None:
                indexer.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(indexer.wait(), 10)
        assert code == 0


async def test_a_sidecar_routes_by_the_index_and_falls_back_when_redis_dies(
    tmp_path: Path, redis_server: RedisServer, redis: Redis
) -> None:
    """Precise routing on the shared index (kv_index_url, no subscriptions of its own): a
    prompt cached on a pod the organic decision does not pick goes there; with Redis
    killed, every caller is still answered, on the organic pick."""
    async with EmulatorFleet(3, POD) as fleet, aiohttp.ClientSession() as session:
        settings = sidecar_config(
            tmp_path, fleet.urls, unregistered_routing="precise", kv_index_url=redis_server.url
        )
        async with (
            indexer_process(fleet.urls, redis_server.url),
            running_sidecar(settings) as (sidecar, stub),
        ):
            head = "Merchant handbook: refunds within 7 days, no coupon stacking. " * 12
            prompt = head + " And then?"
            pick = sidecar.pools.default.router.for_prompt(prompt).backend
            cached = next(url for url in fleet.urls if url != pick)
            body = {"model": POD.model, "prompt": head, "max_tokens": 1}
            async with session.post(f"{cached}/v1/completions", json=body) as answer:
                assert answer.status == 200
            async with UpstreamClient() as client:
                keys = chain(await token_ids(client, cached, head), BLOCK)
            await until_matches(IndexLookup(redis, deadline_s=1.0), keys, {cached: len(keys)})

            request = router_pb2.CompleteRequest(input=prompt, max_tokens=1)
            chunks = [c async for c in stub.Complete(request, timeout=10)]
            assert chunks[0].backend == cached
            assert counted(sidecar.metrics, PRECISE, outcome="moved") == 1
            assert counted(sidecar.metrics, QUERIES, outcome="hit") >= 1

            redis_server.kill()
            for n in range(5):
                request = router_pb2.CompleteRequest(input=f"{prompt} {n}", max_tokens=1)
                chunks = [c async for c in stub.Complete(request, timeout=10)]
                assert "".join(c.text for c in chunks)  # answered
            assert counted(sidecar.metrics, QUERIES, outcome="down") >= 1
            assert counted(sidecar.metrics, PRECISE, outcome="no_answer") >= 1
