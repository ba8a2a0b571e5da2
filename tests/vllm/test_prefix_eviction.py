"""Eviction on a real vLLM pod, and what the sidecar does about it today (issue 28; the
next issue builds on this). A registered, prewarmed prefix is hot on its home pod; then the
pod's KV cache is flooded straight to the pod (not through the sidecar) with more distinct
tokens than it holds, and vLLM's LRU evicts the prefix.

What the sidecar does then, as vLLM reports it: it does not know, and keeps sending the
prefix's queries to the home pod; the first one after the flood is a full prefill there
(cached_tokens 0), which caches the prefix again, so the next is a hit again. The cost of an
eviction is one cold query per prefix, on the right pod.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from prefix_sidecar_tools.vllm import reports
from prefix_sidecar_tools.vllm.fleet import VllmFleet
from prefix_sidecar_tools.vllm.tiny_model import document
from tests.vllm.conftest import VLLM_TESTS, complete_usage, register_prewarmed, router_stub

pytestmark = VLLM_TESTS

FLOOD_WORDS = 2500  # ~3,000 tokens a prompt
FLOOD_IN_FLIGHT = 4


async def flood(session: aiohttp.ClientSession, url: str, model: str, tokens: int) -> int:
    """Distinct prompts straight to the pod until `tokens` prompt tokens went in."""
    sent = 0
    number = 0
    while sent < tokens:
        batch = [document(f"flood-{number + i}", FLOOD_WORDS) for i in range(FLOOD_IN_FLIGHT)]
        number += FLOOD_IN_FLIGHT
        answers = await asyncio.gather(*(reports.complete(session, url, model, p) for p in batch))
        sent += sum(answer["usage"]["prompt_tokens"] for answer in answers)
    return sent


async def test_an_evicted_prefix_costs_one_cold_query_on_its_home_pod(
    fleet: VllmFleet, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    prefix = document("evicted", 2000)
    prefix_tokens = len(await reports.tokenize(session, fleet.urls[0], fleet.model, prefix))
    async with router_stub(fleet, tmp_path) as stub:
        registered = await register_prewarmed(stub, "evicted", prefix)
        home = registered.backends[0]
        counters = await reports.cache_counters(session, home)
        expected = reports.whole_blocks(prefix_tokens, counters.block_size)

        async def query(number: int) -> tuple[str, int]:
            question = f" Question {number}: may coupons stack?"
            backend, usage = await complete_usage(stub, registered.id, question, max_tokens=2)
            return backend, reports.cached_tokens(usage)

        before = await query(0)
        flooded = await flood(session, home, fleet.model, counters.kv_tokens + 4 * expected)
        after = [await query(1), await query(2)]

    print(f"\nhome {home}: {flooded} tokens flooded into a {counters.kv_tokens}-token cache")
    print(f"  cached before {before[1]}, after {[cached for _, cached in after]}")
    assert before == (home, expected)
    assert after == [(home, 0), (home, expected)]
