"""Every block each followed pod holds, by our chained keys (block_keys.py): what precise
organic routing reads to find a prompt's longest cached prefix in the fleet.

Per pod: engine hash -> our key (at most MAX_BLOCKS_PER_POD, the oldest forgotten first, so a
larger cache is credited with its latest blocks only) and the set of our keys; a lookup is
O(pods x matched blocks). A pod unknown or followed from a point on (`resume`) is credited
only with what it stored since: precise routing is a hint over the hash decision, so a
missed credit costs a cache hit, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prefix_sidecar.kv_events.block_keys import PromptKeys, stored_keys
from prefix_sidecar.kv_events.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    on_device,
)
from prefix_sidecar.kv_events.subscriber import KvEventSink

MAX_BLOCKS_PER_POD = 1 << 17  # ~25 MB a pod


class FleetBlocks:
    """A KV-event sink (subscriber.KvEventSink) answering `matches(tokens)`."""

    def __init__(self, max_blocks_per_pod: int = MAX_BLOCKS_PER_POD) -> None:
        self.max_blocks = max_blocks_per_pod
        self._engine: dict[str, dict[int, int]] = {}  # pod -> engine hash -> key, oldest first
        self._keys: dict[str, set[int]] = {}
        self._block_size: dict[str, int] = {}

    def matches(
        self, tokens: Sequence[int], lora_name: str | None = None, salt: str | None = None
    ) -> dict[str, int]:
        """Per pod, how many of `tokens`' whole blocks (of the adapter `lora_name`, under the
        cache `salt`) it holds from the first on (pods holding none are absent)."""
        return self._held(PromptKeys(tokens, lora_name, salt).at)

    def _held(self, keys_at: Callable[[int], Sequence[int]]) -> dict[str, int]:
        found: dict[str, int] = {}
        for pod, keys in self._keys.items():
            size = self._block_size.get(pod)
            if size is None:
                continue
            count = 0
            for key in keys_at(size):
                if key not in keys:
                    break
                count += 1
            if count:
                found[pod] = count
        return found

    # --- routing.precise.BlockSource ------------------------------------------------------

    async def block_sizes(self) -> set[int]:
        return set(self._block_size.values())

    async def longest(self, keys_at: Callable[[int], Sequence[int]]) -> dict[str, int] | None:
        return {pod: n * self._block_size[pod] for pod, n in self._held(keys_at).items()}

    def block_count(self, pod: str) -> int:
        return len(self._keys.get(pod, ()))

    # --- the sink -------------------------------------------------------------------------

    def reset(self, pod: str, known: bool) -> None:
        self._engine.pop(pod, None)
        self._keys.pop(pod, None)
        if known:
            self._engine[pod], self._keys[pod] = {}, set()
        else:
            self._block_size.pop(pod, None)

    def resume(self, pod: str) -> None:
        self.reset(pod, known=True)

    def apply(self, pod: str, events: tuple[KvEvent, ...]) -> None:
        engine, keys = self._engine.get(pod), self._keys.get(pod)
        if engine is None or keys is None:
            return
        for event in events:
            if not on_device(event):
                continue  # an offloaded copy: the index (kv_index) keeps tiers, not this map
            if isinstance(event, BlockStored):
                self._block_size[pod] = event.block_size
                for engine_hash, key in stored_keys(event, engine.get):
                    engine[engine_hash] = key
                    keys.add(key)
            elif isinstance(event, BlockRemoved):
                for engine_hash in event.block_hashes:
                    if engine_hash in engine:
                        keys.discard(engine.pop(engine_hash))
            elif isinstance(event, AllBlocksCleared):
                engine.clear()
                keys.clear()
        while len(engine) > self.max_blocks:
            keys.discard(engine.pop(next(iter(engine))))


class BothSinks:
    """Two sinks hear every event: the residency's and the fleet's block map."""

    def __init__(self, first: KvEventSink, second: KvEventSink) -> None:
        self.first, self.second = first, second

    def reset(self, pod: str, known: bool) -> None:
        self.first.reset(pod, known)
        self.second.reset(pod, known)

    def resume(self, pod: str) -> None:
        self.first.resume(pod)
        self.second.resume(pod)

    def apply(self, pod: str, events: tuple[KvEvent, ...]) -> None:
        self.first.apply(pod, events)
        self.second.apply(pod, events)
