"""`prefix-sidecar kv-indexer` as a process, over emulated pods that publish KV events and a
real redis-server: what a pod caches is found in the index by the prompt's token ids, its
eviction is too, and SIGTERM ends it."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp
from redis.asyncio import Redis

from prefix_sidecar.kv_events.block_keys import chain
from prefix_sidecar.kv_index.lookup import IndexLookup
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.tokenize import token_ids
from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet
from prefix_sidecar_tools.redis_server import RedisServer

BLOCK = 16
POD = EmulatorConfig(time_scale=1000.0, block_size=BLOCK, kv_tokens=64 * BLOCK, kv_events="map")


async def until_matches(lookup: IndexLookup, keys: list[bytes], wanted: dict[str, int]) -> None:
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
        command += [redis_server.url, *(f"--backend={url}" for url in fleet.urls)]
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
