"""vLLM-style automatic prefix cache: chained blocks (16 tokens by default), pinned while
used, LRU.

Algorithm (after vLLM v1's KVCacheManager / BlockPool):
- a request's prompt is a chain of full-block hashes (see tokenizer.block_hashes);
- cached tokens = B * leading blocks already present (B the block size), capped so that at
  least the last prompt token is recomputed (vLLM needs its logits): at most (n_tokens - 1) // B;
- allocating pins every block of the prompt (ref-counted); pinned blocks are never evicted;
- releasing puts blocks whose count reaches 0 on the LRU free list, tail blocks first, so
  eviction eats a prefix from its end (its head is what other requests share);
- capacity counts pinned and free-but-cached blocks; new blocks evict the LRU free ones.
Complexity: O(blocks of the request) per lookup/allocate/release, dict operations only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from prefix_sidecar_tools.emulator.config import BLOCK_SIZE


@dataclass
class CacheCounters:
    evicted_blocks: int = 0
    inserted_blocks: int = 0


class PrefixCache:
    """Block store of one pod. Not thread-safe: lives on one asyncio loop."""

    def __init__(self, capacity_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._refs: dict[int, int] = {}  # pinned blocks -> number of requests using them
        self._free: OrderedDict[int, None] = OrderedDict()  # cached, unpinned; LRU first
        self.counters = CacheCounters()

    @property
    def cached_blocks(self) -> int:
        return len(self._refs) + len(self._free)

    @property
    def pinned_blocks(self) -> int:
        return len(self._refs)

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._refs or block_hash in self._free

    def hit_blocks(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Leading blocks of `hashes` that are cached (capped: the last token is recomputed)."""
        limit = min(len(hashes), max(prompt_tokens - 1, 0) // self.block_size)
        hits = 0
        while hits < limit and self.contains(hashes[hits]):
            hits += 1
        return hits

    def can_allocate(self, hashes: Sequence[int]) -> bool:
        """Would pinning all of `hashes` fit, evicting only unpinned blocks? (A prompt's
        hashes are chained, so no two are equal: what it adds is what is not pinned.)"""
        pinned = len(self._refs.keys() & hashes)  # one C-level pass
        return len(self._refs) + len(hashes) - pinned <= self.capacity_blocks

    def fits_ever(self, hashes: Sequence[int]) -> bool:
        """Could this prompt fit an otherwise empty cache?"""
        return len(hashes) <= self.capacity_blocks

    def allocate(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Pin every block of a prompt, inserting missing ones; call can_allocate first.
        Returns the hashes it evicted and the indexes (into `hashes`) it inserted: what
        the pod's KV events say (BlockRemoved, then BlockStored)."""
        if not self.can_allocate(hashes):
            raise RuntimeError("prefix cache: allocation does not fit; check can_allocate")
        refs, free = self._refs, self._free
        missing: list[int] = []
        for index, h in enumerate(hashes):  # pin hits first so eviction below cannot take them
            count = refs.get(h)
            if count is not None:
                refs[h] = count + 1
            elif h in free:
                del free[h]
                refs[h] = 1
            else:
                missing.append(index)
        evict = len(refs) + len(free) + len(missing) - self.capacity_blocks
        evicted = [free.popitem(last=False)[0] for _ in range(max(evict, 0))]
        self.counters.evicted_blocks += len(evicted)
        for index in missing:
            refs[hashes[index]] = 1
        self.counters.inserted_blocks += len(missing)
        return evicted, missing

    def release(self, hashes: Sequence[int]) -> None:
        """Unpin a finished request's blocks; the tail goes first in eviction order."""
        for h in reversed(hashes):
            count = self._refs.get(h)
            if count is None:
                continue  # dropped by reset() while pinned
            if count > 1:
                self._refs[h] = count - 1
            else:
                del self._refs[h]
                self._free[h] = None

    def reset(self) -> list[int]:
        """Drop every unpinned block (like vLLM's /reset_prefix_cache); returns them."""
        dropped = list(self._free)
        self._free.clear()
        return dropped
