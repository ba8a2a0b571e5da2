"""The index writer and a sidecar's lookup over a real redis-server: blocks stored, removed,
a pod restarted, Redis killed (the writer rewrites what it knows once Redis is back) and
Redis paused (the lookup gives up at its deadline, no error to anyone)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from redis.asyncio import Redis

from prefix_sidecar.kv_events.block_keys import KEY_BYTES, chain
from prefix_sidecar.kv_events.decode import BlockRemoved
from prefix_sidecar.kv_index import layout
from prefix_sidecar.kv_index.lookup import DOWN_S, IndexLookup
from prefix_sidecar.kv_index.writer import PIPELINE_COMMANDS, IndexWriter
from prefix_sidecar_tools.redis_server import RedisServer
from tests.kv_events.test_residency import BLOCK, stored_chunks
from tests.server.conftest import wait_for

PROMPT = list(range(500, 500 + 5 * BLOCK))  # 5 whole blocks
KEYS = chain(PROMPT, BLOCK)


async def hset(redis: Redis, name: str, fields: dict[str, int]) -> None:
    await redis.execute_command("HSET", name, *(x for pair in fields.items() for x in pair))


@contextlib.asynccontextmanager
async def writing(redis: Redis) -> AsyncIterator[IndexWriter]:
    writer = IndexWriter(redis)
    task = asyncio.create_task(writer.run())
    try:
        yield writer
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_stored_blocks_are_found_and_removed_ones_end_the_match(redis: Redis) -> None:
    outcomes: list[str] = []
    lookup = IndexLookup(redis, deadline_s=1.0, on_outcome=outcomes.append)
    async with writing(redis) as writer:
        for pod in ("http://a", "http://b"):
            writer.reset(pod, known=True)
        writer.apply("http://a", tuple(stored_chunks(PROMPT, 2**63 + 10)))
        writer.apply("http://b", tuple(stored_chunks(PROMPT[: 2 * BLOCK], 2**63 + 10)))
        await wait_for(lambda: writer.settled, 5, "written")
        assert await lookup.matches(KEYS) == {"http://a": 5, "http://b": 2}

        writer.apply("http://a", (BlockRemoved((2**63 + 12,)),))  # its third block evicted
        await wait_for(lambda: writer.settled, 5)
        assert await lookup.matches(KEYS) == {"http://a": 2, "http://b": 2}

        writer.reset("http://b", known=True)  # b restarted: empty
        writer.reset("http://a", known=False)  # a gone
        await wait_for(lambda: writer.settled, 5)
        assert await lookup.matches(KEYS) == {}
        assert await lookup.matches(chain(list(range(9, 9 + BLOCK)), BLOCK)) == {}
    assert outcomes == ["hit", "hit", "miss", "miss"]
    # b's and a's old fields were deleted, not only voided
    left = await redis.execute_command(
        "HGETALL", layout.block_name(layout.DEFAULT_NAMESPACE, KEYS[4])
    )
    assert not left, (left, writer.pods)


async def test_each_tier_of_a_block_has_its_field_and_leaves_alone(redis: Redis) -> None:
    """An offloading pod stores a block's CPU copy under the same hash, then evicts the GPU
    one: the index keeps `pod@cpu` and drops `pod@gpu`, and the copy still counts."""
    lookup = IndexLookup(redis, deadline_s=1.0)
    name = layout.block_name(layout.DEFAULT_NAMESPACE, KEYS[4])
    async with writing(redis) as writer:
        writer.reset("http://a", known=True)
        writer.apply("http://a", tuple(stored_chunks(PROMPT, 70, medium="GPU")))
        writer.apply("http://a", tuple(stored_chunks(PROMPT, 70, medium="CPU")))
        await wait_for(lambda: writer.settled, 5, "written")
        assert sorted(await redis.hkeys(name)) == [b"http://a@cpu", b"http://a@gpu"]
        writer.apply("http://a", (BlockRemoved(tuple(range(70, 75)), medium="GPU"),))
        await wait_for(lambda: writer.settled, 5)
        assert await redis.hkeys(name) == [b"http://a@cpu"]
        assert await lookup.matches(KEYS) == {"http://a": 5}
        writer.apply("http://a", (BlockRemoved(tuple(range(70, 75)), medium="CPU"),))
        await wait_for(lambda: writer.settled, 5)
        assert await redis.hkeys(name) == [] and await lookup.matches(KEYS) == {}


async def test_a_redis_restarted_empty_is_written_again_and_lookups_fall_back_meanwhile(
    redis_server: RedisServer, redis: Redis
) -> None:
    outcomes: list[str] = []
    lookup = IndexLookup(redis, deadline_s=1.0, on_outcome=outcomes.append)
    async with writing(redis) as writer:
        writer.reset("http://a", known=True)
        writer.apply("http://a", tuple(stored_chunks(PROMPT, 1)))
        await wait_for(lambda: writer.settled, 5)
        assert await lookup.matches(KEYS) == {"http://a": 5}

        redis_server.kill()
        started = time.perf_counter()
        assert await lookup.matches(KEYS) is None  # refused at once: no caller waits
        assert await lookup.matches(KEYS) is None  # not asked again for DOWN_S
        assert time.perf_counter() - started < 0.2
        assert outcomes[-2:] == ["down", "down"]
        writer.apply("http://a", tuple(stored_chunks(PROMPT[:BLOCK] + [7] * BLOCK, 100)))
        await wait_for(lambda: writer.rewrite, 5, "the writer to notice")

        await redis_server.start()  # empty: no persistence
        await wait_for(lambda: not writer.rewrite, 10, "the rewrite")
        await asyncio.sleep(DOWN_S)
        assert await lookup.matches(KEYS) == {"http://a": 5}
        other = chain(PROMPT[:BLOCK] + [7] * BLOCK, BLOCK)
        assert await lookup.matches(other) == {"http://a": 2}  # stored while Redis was down


async def test_a_stalled_redis_costs_a_lookup_its_deadline_and_no_more(
    redis_server: RedisServer, redis: Redis
) -> None:
    outcomes: list[str] = []
    lookup = IndexLookup(redis, deadline_s=0.005, on_outcome=outcomes.append)
    assert await lookup.matches(KEYS) == {}
    redis_server.pause(True)
    try:
        started = time.perf_counter()
        for _ in range(3):
            assert await lookup.matches(KEYS) is None
        assert time.perf_counter() - started < 0.5
    finally:
        redis_server.pause(False)
    assert outcomes == ["miss", "timeout", "timeout", "timeout"]
    assert await lookup.matches(KEYS) == {}  # a connection cut at the deadline is not reused


async def test_a_pod_matches_from_the_first_block_on_and_only_in_its_generation(
    redis: Redis,
) -> None:
    """The lookup's script, over fields written by hand: a stale generation, a gap, a tier."""
    namespace = layout.DEFAULT_NAMESPACE
    await hset(redis, layout.pods_name(namespace), {"http://a": 7, "http://b": 9, "http://c": 1})
    keys = [int.from_bytes(bytes([n]) * KEY_BYTES, "little") for n in range(4)]
    held = [
        {"http://a@gpu": 7, "http://b@gpu": 9, "http://c@gpu": 0},  # c: an old generation
        {"http://a@gpu": 7, "http://b@cpu": 9},
        {"http://b@cpu": 9, "http://c@gpu": 1},  # c missed block 1: no match
        {"http://a@gpu": 7},  # a missed block 3: stays at 2
    ]
    for key, fields in zip(keys, held, strict=True):
        await hset(redis, layout.block_name(namespace, key), fields)
    lookup = IndexLookup(redis, deadline_s=1.0)
    assert await lookup.matches(keys) == {"http://a": 2, "http://b": 3}
    assert await lookup.matches(keys[1:]) == {"http://a": 1, "http://b": 2}  # a chain's own counts


async def test_a_long_chain_matches_to_its_last_sampled_block_held(redis: Redis) -> None:
    """Past MAX_LOOKUP_BLOCKS the script reads sampled blocks and answers their counts."""
    namespace = layout.DEFAULT_NAMESPACE
    await hset(redis, layout.pods_name(namespace), {"http://a": 3})
    keys = list(range(1, 601))
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys[:400]:
            pipe.hset(layout.block_name(namespace, key), mapping={"http://a@gpu": 3})
        await pipe.execute()
    expected = max(count for count, _ in layout.sampled(keys) if count <= 400)
    assert 395 < expected <= 400
    assert await IndexLookup(redis, deadline_s=1.0).matches(keys) == {"http://a": expected}


async def test_a_block_removed_while_the_index_is_rewritten_is_removed_from_it(
    redis: Redis,
) -> None:
    """The rewrite writes a pod's blocks in several pipelines; a removal heard while it runs
    must still reach Redis (it was dropped as 'covered by the rewrite')."""
    tokens = list(range(1, 1 + 3 * PIPELINE_COMMANDS * BLOCK))
    keys = chain(tokens, BLOCK)
    writer = IndexWriter(redis)
    writer.reset("http://a", known=True)
    writer.apply("http://a", tuple(stored_chunks(tokens, 1, per_event=100)))
    task = asyncio.create_task(writer.run())
    try:
        while writer.written < PIPELINE_COMMANDS:  # the rewrite has begun, not ended
            await asyncio.sleep(0)
        assert writer.written < len(keys)
        writer.apply("http://a", (BlockRemoved((len(keys),)),))  # the chain's tail evicted
        await wait_for(lambda: writer.settled, 10, "written")
        last = layout.block_name(layout.DEFAULT_NAMESPACE, keys[-1])
        assert await redis.execute_command("HGETALL", last) == {}
        found = await IndexLookup(redis, deadline_s=1.0).matches(keys)
        assert found is not None and 0 < found["http://a"] < len(keys)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_nothing_is_written_while_the_history_is_read_then_where_it_ended(
    redis: Redis,
) -> None:
    """A starting indexer reads each pod's history (the replay) before it writes: written as
    it came, the index would show blocks the history goes on to remove."""
    reading = ["reading KV events: 1 of 1 pods' history still coming"]
    writer = IndexWriter(redis)
    task = asyncio.create_task(writer.run(lambda: reading[0] if reading else None))
    try:
        writer.reset("http://a", known=True)
        writer.apply("http://a", tuple(stored_chunks(PROMPT, 2**63 + 10)))
        await asyncio.sleep(0.2)
        assert writer.written == 0 and not writer.settled
        writer.apply("http://a", (BlockRemoved((2**63 + 12,)),))  # later in the history
        reading.clear()
        await wait_for(lambda: writer.settled, 5, "written")
        assert await IndexLookup(redis, deadline_s=1.0).matches(KEYS) == {"http://a": 2}
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
