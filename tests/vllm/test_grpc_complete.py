"""A registered prefix through a real sidecar to real vLLM pods: RegisterPrefix with
prewarm, then thin queries through gRPC Complete. What counts is what vLLM reports: the
usage's cached_tokens in the pod's own events (raw_events), its /tokenize count, and its
/metrics prefix-cache counters.

The prefix is a few thousand tokens; it ends with a full stop and each query starts with a
space, so the ByteLevel BPE has no merge across the join and the first query after the
prewarm is served with every whole block of the prefix from the cache.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp

from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.vllm.fleet import VllmFleet
from prefix_sidecar_tools.vllm.reports import (
    cache_counters,
    cached_tokens,
    complete,
    tokenize,
    whole_blocks,
)
from prefix_sidecar_tools.vllm.tiny_model import document
from tests.vllm.conftest import VLLM_TESTS, complete_usage, register_prewarmed, router_stub

pytestmark = VLLM_TESTS

QUERIES = 3


async def test_first_query_after_prewarm_hits_every_whole_block_of_the_prefix(
    fleet: VllmFleet, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    prefix = document("grpc-registered", 2400)
    prefix_ids = await tokenize(session, fleet.urls[0], fleet.model, prefix)
    assert len(prefix_ids) > 2000, "the prefix should be a few thousand tokens"

    async with router_stub(fleet, tmp_path) as stub:
        registered = await register_prewarmed(stub, "rules", prefix)
        home = registered.backends[0]
        warmed = [e for e in registered.prewarm if e.state == router_pb2.PrewarmEvent.WARMED]
        assert [e.backend for e in warmed] == [home], registered.prewarm
        assert warmed[0].prompt_tokens == len(prefix_ids)  # vLLM's count, relayed
        before = await cache_counters(session, home)
        expected = whole_blocks(len(prefix_ids), before.block_size)

        seen: list[tuple[str, int, int]] = []
        for number in range(QUERIES):
            query = f" Question {number}: which clause applies to the order?"
            backend, usage = await complete_usage(stub, registered.id, query)
            seen.append((backend, usage["prompt_tokens"], cached_tokens(usage)))
        after = await cache_counters(session, home)

    print(f"\nprefix {len(prefix_ids)} tokens, block {before.block_size}, home {home}")
    for backend, prompt_tokens, cached in seen:
        print(f"  {backend}: prompt {prompt_tokens} cached {cached} (whole blocks {expected})")
    assert [backend for backend, _, _ in seen] == [home] * QUERIES
    assert all(prompt > len(prefix_ids) for _, prompt, _ in seen)
    # the first query already: every whole block of the prefix, as vLLM counts it
    assert [cached for _, _, cached in seen] == [expected] * QUERIES
    # vLLM's own counters on the home pod agree with the usages it sent
    assert after.hits - before.hits == expected * QUERIES
    assert after.queries - before.queries == sum(prompt for _, prompt, _ in seen)


async def test_prewarm_warms_every_pod_of_the_replica_set(
    fleet: VllmFleet, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    prefix = document("grpc-replicated", 2000)
    prefix_ids = await tokenize(session, fleet.urls[0], fleet.model, prefix)
    async with router_stub(fleet, tmp_path) as stub:
        registered = await register_prewarmed(stub, "replicated", prefix, len(fleet.urls))
    assert sorted(registered.backends) == sorted(fleet.urls)
    # each pod of the set now holds the prefix: the same prompt straight to it is a hit
    for url in registered.backends:
        before = await cache_counters(session, url)
        usage = (await complete(session, url, fleet.model, prefix))["usage"]
        assert cached_tokens(usage) == whole_blocks(len(prefix_ids) - 1, before.block_size)
