"""The KV-event sink of `prefix-sidecar kv-indexer`: every pod's stored and removed blocks
written to the shared index in Redis (layout.py), in pipelines, off the event path.

Events become operations on a bounded queue, drained by one task. What the indexer knows of
each pod (at most MAX_BLOCKS_PER_POD blocks, the oldest dropped from the index past that) can
always be written again: when Redis fails or the queue overflows, the queue is dropped and,
once Redis answers, every pod gets a new generation and its blocks are written anew. A stale
field is never read as true (its generation is not the pod's).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from prefix_sidecar.kv_events.block_keys import stored_keys
from prefix_sidecar.kv_events.decode import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from prefix_sidecar.kv_index import layout

logger = logging.getLogger(__name__)

MAX_BLOCKS_PER_POD = 1 << 18  # a large GPU's KV cache at 16 tokens a block
MAX_PENDING = 1 << 18  # queued operations; past that, a full rewrite instead
PIPELINE_COMMANDS = 1000
RETRY_S = (0.2, 5.0)  # the first and the longest wait between two tries at Redis
CATCH_UP_POLL_S = 0.05

# ("hset", block name, field, generation) | ("hdel", block name, field)
# | ("pod", pod, generation or "" to drop it) | ("size", pod, block size or "")
Operation = tuple[str, str, str, str] | tuple[str, str, str]


@dataclass
class PodBlocks:
    generation: str = field(default_factory=layout.new_generation)
    block_size: int = 0
    # (engine hash, field) -> our key. A block has a field per tier (medium) that holds it:
    # an offloading pod stores it on the CPU and removes it from the GPU, hash unchanged.
    engine: dict[tuple[int, str], int] = field(default_factory=dict)

    def keyer(self, name_field: str) -> Callable[[int], int | None]:
        """Our key of an engine hash the pod stored in the tier of `name_field`."""
        return lambda engine_hash: self.engine.get((engine_hash, name_field))


class IndexWriter:
    """subscriber.KvEventSink over a Redis client (redis.asyncio.Redis)."""

    def __init__(self, redis: Any, namespace: str = layout.DEFAULT_NAMESPACE) -> None:
        self.redis, self.namespace = redis, namespace
        self.pods: dict[str, PodBlocks] = {}
        self.pending: deque[Operation] = deque()
        self.rewrite = True  # the indexer starts: whatever Redis holds of the pods is void
        self.holding = True  # until run() starts writing: the first rewrite writes it all
        self.wake = asyncio.Event()
        self.written = 0  # commands Redis took (for the tests and the log)
        self._sending = False

    @property
    def settled(self) -> bool:
        """Redis holds everything heard so far."""
        return not (self.pending or self.rewrite or self._sending)

    # --- the sink ---------------------------------------------------------------------

    def reset(self, pod: str, known: bool) -> None:
        old = self.pods.pop(pod, None)
        if old is not None:
            self._queue(self._hdel_all(old.engine))
        if known:
            self.pods[pod] = fresh = PodBlocks()
            self._queue([("pod", pod, fresh.generation)])
        else:
            self._queue([("pod", pod, ""), ("size", pod, "")])

    def resume(self, pod: str) -> None:
        # The index only claims what it heard stored: a partial past is no past.
        self.reset(pod, known=True)

    def apply(self, pod: str, events: tuple[KvEvent, ...]) -> None:
        blocks = self.pods.get(pod)
        if blocks is None:
            return
        operations: list[Operation] = []
        engine = blocks.engine
        for event in events:
            if isinstance(event, BlockStored):
                if event.block_size != blocks.block_size:
                    blocks.block_size = event.block_size
                    operations.append(("size", pod, str(event.block_size)))
                name_field = layout.field(pod, event.medium)
                for engine_hash, key in stored_keys(event, blocks.keyer(name_field)):
                    engine[(engine_hash, name_field)] = key
                    name = layout.block_name(self.namespace, key)
                    operations.append(("hset", name, name_field, blocks.generation))
            elif isinstance(event, BlockRemoved):
                name_field = layout.field(pod, event.medium)  # that tier's copy only
                for engine_hash in event.block_hashes:
                    dropped = engine.pop((engine_hash, name_field), None)
                    if dropped is not None:
                        operations.append(self._hdel(name_field, dropped))
            elif isinstance(event, AllBlocksCleared):
                operations += self._hdel_all(engine)
                engine.clear()
        while len(engine) > MAX_BLOCKS_PER_POD:
            oldest = next(iter(engine))
            operations.append(self._hdel(oldest[1], engine.pop(oldest)))
        self._queue(operations)

    # --- to Redis -----------------------------------------------------------------------

    async def run(self, catching_up: Callable[[], object] = lambda: None) -> None:
        """Drain the queue into Redis until cancelled, retrying with backoff. Nothing is
        written while `catching_up()` says the pods' history is still being read: written
        as it came, the index would show blocks the history goes on to remove (a lookup
        meanwhile routed on them); then one rewrite writes where the history ended."""
        while catching_up() is not None:
            await asyncio.sleep(CATCH_UP_POLL_S)
        self.holding = False
        self.rewrite = True
        wait = RETRY_S[0]
        while True:
            if not self.pending and not self.rewrite:
                self.wake.clear()
                await self.wake.wait()
            try:
                if self.rewrite:
                    await self._rewrite()
                await self._drain()
                wait = RETRY_S[0]
            except (TimeoutError, OSError, RedisError) as exc:
                if not self.rewrite:
                    logger.warning(
                        "kv-index: Redis failed (%s); rewriting the index when it is back", exc
                    )
                self.rewrite = True
                self.pending.clear()
                await asyncio.sleep(wait)
                wait = min(RETRY_S[1], wait * 2)

    async def _rewrite(self) -> None:
        """Every pod a new generation, every block it holds written under it. What is
        heard meanwhile is queued and sent after (a block the rewrite already wrote may be
        removed while it runs); a failure or an overflow meanwhile asks for another."""
        self.pending.clear()
        self.rewrite = False
        for blocks in self.pods.values():
            blocks.generation = layout.new_generation()
        batch: list[Operation] = []
        for operation in self._everything():
            batch.append(operation)
            if len(batch) >= PIPELINE_COMMANDS:
                await self._send(batch)
                batch = []
        await self._send(batch)

    def _everything(self) -> Iterator[Operation]:
        for pod, blocks in list(self.pods.items()):
            yield ("pod", pod, blocks.generation)
            if blocks.block_size:
                yield ("size", pod, str(blocks.block_size))
            for (_, name_field), key in list(blocks.engine.items()):
                name = layout.block_name(self.namespace, key)
                yield ("hset", name, name_field, blocks.generation)

    async def _drain(self) -> None:
        while self.pending and not self.rewrite:
            count = min(PIPELINE_COMMANDS, len(self.pending))
            batch = [self.pending.popleft() for _ in range(count)]
            await self._send(batch)

    async def _send(self, batch: list[Operation]) -> None:
        if not batch:
            return
        self._sending = True
        pipe = self.redis.pipeline(transaction=False)
        names = {
            "pod": layout.pods_name(self.namespace),
            "size": layout.block_sizes_name(self.namespace),
        }
        for operation in batch:
            if operation[0] == "hset":
                pipe.hset(operation[1], operation[2], operation[3])  # type: ignore[misc]
            elif operation[0] == "hdel":
                pipe.hdel(operation[1], operation[2])
            elif operation[2]:
                pipe.hset(names[operation[0]], operation[1], operation[2])
            else:
                pipe.hdel(names[operation[0]], operation[1])
        try:
            await pipe.execute()
        finally:
            self._sending = False
        self.written += len(batch)

    def _queue(self, operations: Any) -> None:
        if self.holding:
            return  # the first rewrite writes where the history ended
        # Queued while a rewrite waits too: the rewrite drops them as it starts.
        self.pending.extend(operations)
        if len(self.pending) > MAX_PENDING:
            logger.warning("kv-index: %d operations queued; rewriting the index", MAX_PENDING)
            self.pending.clear()
            self.rewrite = True
        self.wake.set()

    def _hdel(self, name_field: str, key: int) -> Operation:
        """The operation that drops the block `key`'s field `name_field` from the index."""
        return ("hdel", layout.block_name(self.namespace, key), name_field)

    def _hdel_all(self, engine: dict[tuple[int, str], int]) -> list[Operation]:
        """The operations that drop every block of a pod's `engine` map from the index."""
        return [self._hdel(name_field, key) for (_, name_field), key in engine.items()]
