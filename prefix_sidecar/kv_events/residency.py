"""Which pods hold all of a registered prefix's whole blocks, from the pods' KV events.

Blocks are our chained keys (block_keys.py). Per pod only the blocks on a registered prefix's
chain and the latest RECENT_BLOCKS others are kept (a prefix's token ids often come after its
prewarm was stored): memory is (prefixes x blocks + RECENT_BLOCKS) x pods, with chains at
most MAX_BLOCK_SIZES block sizes. Only the pod's own tier counts (decode.on_device). Each
pod's peak block count is kept: vLLM evicts only when full, so once a pod has evicted it is
about its capacity (reprewarm.py). A pod followed from a point on (`resume`) says True for a
prefix stored since, False for one with a block removed since, else None.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prefix_sidecar.kv_events.block_keys import chain, stored_keys
from prefix_sidecar.kv_events.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    on_device,
)

MAX_BLOCK_SIZES = 4
RECENT_BLOCKS = 2048  # ~0.4 MB a pod


class Residency:
    """The KV-event sink (subscriber.KvEventSink) that answers `resident(prefix_id)`."""

    def __init__(self) -> None:
        self._prefixes: dict[str, tuple[tuple[int, ...], str | None]] = {}
        self._chains: dict[int, dict[str, list[int]]] = {}  # block size -> prefix -> keys
        self._wanted: dict[int, set[int]] = {}  # block size -> every key on a chain
        self._held: dict[str, set[int]] = {}  # pod -> our keys it holds
        self._engine: dict[str, dict[int, int]] = {}  # pod -> engine hash -> our key, oldest first
        self._block_size: dict[str, int] = {}  # pod -> the block size it reports
        # Pods followed from a point on (`resume`: replay no longer held batch 0, a gap, a
        # batch that did not decode): per pod, the registered prefixes' blocks removed since.
        self._removed: dict[str, set[int]] = {}
        self._cached: dict[str, int] = {}  # pod -> blocks it holds, as its events say
        self._peak: dict[str, int] = {}  # pod -> the most it held (kept over resets)

    # --- registered prefixes --------------------------------------------------------------

    def watch_prefix(
        self, prefix_id: str, token_ids: Sequence[int], lora_name: str | None = None
    ) -> None:
        """Follow `prefix_id`, whose prompt starts with `token_ids` (from the pod's
        /tokenize; only whole blocks count, so a partial tail never matters)."""
        self._prefixes[prefix_id] = (tuple(token_ids), lora_name)
        for size in self._chains:
            self._chains[size][prefix_id] = chain(token_ids, size, lora_name)
            self._rebuild(size)

    def forget_prefix(self, prefix_id: str) -> None:
        if self._prefixes.pop(prefix_id, None) is None:
            return
        for size, chains in self._chains.items():
            chains.pop(prefix_id, None)
            self._rebuild(size)
        # Keys held for that prefix alone stay until removed or reset: bounded, and harmless.

    def resident(self, prefix_id: str) -> list[str]:
        """The pods known to hold every whole block of the prefix, sorted."""
        return sorted(pod for pod in self._held if self.holds(pod, prefix_id))

    def capacity(self, pod: str) -> int:
        """The most blocks `pod` was heard to hold at once (0: nothing heard)."""
        return self._peak.get(pod, 0)

    def footprint(self, pod: str, prefix_ids: Iterable[str]) -> int:
        """The distinct whole blocks of these prefixes at `pod`'s block size (shared heads
        counted once); 0 while the pod's block size or a prefix's token ids are unknown."""
        chains = self._chains.get(self._block_size.get(pod, 0), {})
        return len({key for prefix_id in prefix_ids for key in chains.get(prefix_id, ())})

    def keep_pods(self, pods: Iterable[str]) -> None:
        """Only `pods` are followed now: all of any other goes, its peak too."""
        kept = set(pods)
        for pod in [p for p in self._held.keys() | self._peak.keys() if p not in kept]:
            self.reset(pod, known=False)
            self._peak.pop(pod, None)

    def known(self, pod: str) -> bool:
        return pod in self._held

    def holds(self, pod: str, prefix_id: str) -> bool | None:
        """Whether `pod` holds every whole block of the prefix; None when that is unknown
        (the pod's events, or the prefix's token ids)."""
        held = self._held.get(pod)
        if held is None or prefix_id not in self._prefixes:
            return None
        size = self._block_size.get(pod)
        if size is None:
            return None if pod in self._removed else False  # known: an empty cache
        keys = self._chains.get(size, {}).get(prefix_id)
        if not keys:
            return None
        if all(key in held for key in keys):
            return True
        removed = self._removed.get(pod)
        if removed is None:
            return False
        # Partial: a block missing may be one it stored before we followed it, unless we
        # heard it removed.
        return False if any(key in removed for key in keys) else None

    # --- the sink ---------------------------------------------------------------------------

    def reset(self, pod: str, known: bool) -> None:
        """Everything heard of `pod` is void: empty (`known`) or unknown, then forgotten."""
        self._removed.pop(pod, None)
        self._cached.pop(pod, None)
        if known:
            self._held[pod], self._engine[pod] = set(), {}
        else:
            self._held.pop(pod, None)
            self._engine.pop(pod, None)
            self._block_size.pop(pod, None)

    def resume(self, pod: str) -> None:
        """What `pod` held is not known any more, but what it stores from now on is."""
        self.reset(pod, known=True)
        self._removed[pod] = set()

    def apply(self, pod: str, events: tuple[KvEvent, ...]) -> None:
        if pod not in self._held:
            return  # unknown until the subscriber says it is known again
        held, engine = self._held[pod], self._engine[pod]
        for event in events:
            if not on_device(event):
                continue  # a copy in another tier (offloaded): not what a request reuses
            if isinstance(event, BlockStored):
                self._stored(pod, event, held, engine)
            elif isinstance(event, BlockRemoved):
                self._cached[pod] = max(0, self._cached.get(pod, 0) - len(event.block_hashes))
                removed = self._removed.get(pod)
                wanted = self._wanted.get(self._block_size.get(pod, 0), set())
                for engine_hash in event.block_hashes:
                    key = engine.pop(engine_hash, None)
                    if key is not None:
                        held.discard(key)
                        if removed is not None and key in wanted:
                            removed.add(key)  # bounded: blocks of registered prefixes
            elif isinstance(event, AllBlocksCleared):
                self._cached.pop(pod, None)
                held.clear()
                engine.clear()
                self._removed.pop(pod, None)  # empty: known whole again

    def _stored(self, pod: str, event: BlockStored, held: set[int], engine: dict[int, int]) -> None:
        size = event.block_size
        self._block_size[pod] = size
        fresh = sum(1 for engine_hash in event.block_hashes if engine_hash not in engine)
        cached = self._cached[pod] = self._cached.get(pod, 0) + fresh
        if cached > self._peak.get(pod, 0):
            self._peak[pod] = cached
        if len(self._chains) >= MAX_BLOCK_SIZES and size not in self._chains:
            return
        removed = self._removed.get(pod)
        for engine_hash, key in stored_keys(event, engine.get):
            held.add(key)
            engine[engine_hash] = key
            if removed is not None:
                removed.discard(key)
        wanted = self._wanted_at(size)
        while len(engine) > RECENT_BLOCKS + len(wanted):  # the oldest block off every chain
            oldest, key = next(iter(engine.items()))
            del engine[oldest]
            if key in wanted:
                engine[oldest] = key  # kept, now the newest
            else:
                held.discard(key)

    def _wanted_at(self, size: int) -> set[int]:
        if size not in self._chains:
            self._chains[size] = {
                name: chain(tokens, size, lora) for name, (tokens, lora) in self._prefixes.items()
            }
            self._rebuild(size)
        return self._wanted[size]

    def _rebuild(self, size: int) -> None:
        self._wanted[size] = {key for keys in self._chains[size].values() for key in keys}
