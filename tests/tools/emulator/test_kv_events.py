"""The emulator's KV events (`--kv-events map|array`), read by the sidecar's own subscriber
over real sockets: what it stores (with the token ids /tokenize gives), what an eviction
removes ahead of the store that needed the room, a reset, replay, and a long prefill cut
into batches under the subscriber's payload cap."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import pytest

from prefix_sidecar.kv_events.decode import (
    MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from prefix_sidecar.kv_events.subscriber import KvEventSubscriber
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar_tools.emulator import run_emulator
from prefix_sidecar_tools.emulator.kv_events import BATCH_TOKENS
from tests.kv_events.publisher import RecordingSink
from tests.tools.emulator.conftest import FAST

BLOCK = 16
pytestmark = pytest.mark.parametrize("encoding", ["map", "array"])


@contextlib.asynccontextmanager
async def followed(
    encoding: str, kv_tokens: int = 64 * BLOCK
) -> AsyncIterator[tuple[str, RecordingSink, KvEventSubscriber]]:
    config = dataclasses.replace(FAST, kv_events=encoding, kv_tokens=kv_tokens, block_size=BLOCK)
    sink = RecordingSink()
    async with run_emulator(config) as url, UpstreamClient() as client:
        subscriber = KvEventSubscriber(client, sink, retry_s=0.2)
        subscriber.set_pods([url])
        try:
            await sink.until(lambda: ("reset", True) in sink.heard)  # connected, history read
            yield url, sink, subscriber
        finally:
            await subscriber.stop()


async def complete(session: aiohttp.ClientSession, url: str, prompt: str) -> int:
    body = {"model": FAST.model, "prompt": prompt, "max_tokens": 1}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        usage = (await response.json())["usage"]
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def tokenize(session: aiohttp.ClientSession, url: str, prompt: str) -> list[int]:
    async with session.post(f"{url}/tokenize", json={"prompt": prompt}) as response:
        return list((await response.json())["tokens"])


def stored(sink: RecordingSink) -> list[BlockStored]:
    return [event for event in sink.events() if isinstance(event, BlockStored)]


async def test_a_prompt_is_stored_block_by_block_with_its_token_ids(encoding: str) -> None:
    prompt = "the rules of the mega sale: " * 20  # 560 bytes: 140 tokens, 8 whole blocks
    async with followed(encoding) as (url, sink, _), aiohttp.ClientSession() as session:
        await complete(session, url, prompt)
        await sink.until(lambda: stored(sink))
        ids = await tokenize(session, url, prompt)
        assert await complete(session, url, prompt) == 8 * BLOCK  # a hit publishes nothing
        events = stored(sink)
    assert len(events) == 1
    event = events[0]
    assert len(event.block_hashes) == 8 and event.parent_block_hash is None
    assert list(event.token_ids) == ids[: 8 * BLOCK] and event.block_size == BLOCK
    assert all(0 <= h < 2**64 for h in event.block_hashes)


async def test_an_eviction_is_removed_ahead_of_the_store_that_needed_the_room(
    encoding: str,
) -> None:
    small = followed(encoding, kv_tokens=12 * BLOCK)
    async with small as (url, sink, _), aiohttp.ClientSession() as session:
        await complete(session, url, "a" * 8 * BLOCK * 4)  # 8 blocks of 12
        await complete(session, url, "b" * 8 * BLOCK * 4)  # 4 of a's must go
        await sink.until(lambda: len(stored(sink)) == 2)
    kinds = [type(event).__name__ for event in sink.events()]
    assert kinds == ["BlockStored", "BlockRemoved", "BlockStored"]
    first, removed = sink.events()[0], sink.events()[1]
    assert isinstance(first, BlockStored) and isinstance(removed, BlockRemoved)
    assert removed.block_hashes == first.block_hashes[:3:-1]  # a's tail first, LRU


async def test_a_reset_clears_all_and_a_late_subscriber_replays(encoding: str) -> None:
    async with followed(encoding) as (url, sink, _):
        async with aiohttp.ClientSession() as session:
            await complete(session, url, "c" * 4 * BLOCK * 4)
            async with session.post(f"{url}/reset_prefix_cache") as response:
                assert response.status == 200
            await sink.until(lambda: any(isinstance(e, AllBlocksCleared) for e in sink.events()))
        late = RecordingSink()
        async with UpstreamClient() as client:
            again = KvEventSubscriber(client, late, retry_s=0.2)
            again.set_pods([url])
            try:
                await late.until(lambda: len(late.events()) == 2)  # both, from the replay
            finally:
                await again.stop()
    assert [type(e).__name__ for e in late.events()] == ["BlockStored", "AllBlocksCleared"]
    assert late.heard[0] == ("reset", True)


async def test_a_long_prefill_comes_in_batches_under_the_payload_cap(encoding: str) -> None:
    tokens = 4 * BATCH_TOKENS + 3 * BLOCK
    async with followed(encoding, kv_tokens=tokens + 8 * BLOCK) as (url, sink, subscriber):
        async with aiohttp.ClientSession() as session:
            await complete(session, url, "x" * tokens * 4)
            await sink.until(
                lambda: sum(len(e.block_hashes) for e in stored(sink)) == tokens // BLOCK
            )
        held = subscriber.feeds[url]
        assert held.next_seq == 5  # 4 batches of BATCH_TOKENS, then the last 3 blocks
    chained = stored(sink)
    assert all(chained[i].parent_block_hash == chained[i - 1].block_hashes[-1] for i in range(1, 5))
    assert MAX_PAYLOAD_BYTES > 3 * BATCH_TOKENS  # a batch's token ids fit with room to spare
