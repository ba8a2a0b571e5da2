"""Learned anchors: where unregistered prompts branch, learnt from traffic in bounded memory.

Prompts are hashed in chained blocks (`_core.chain_keys`, contract 9a), so prompts share key
i only if they share their first i + 1 blocks. The table records each block's first
successor; a block seen with MIN_FANOUT distinct successors is an anchor (a system prompt's
or few-shot template's end). A prompt's anchor is the SHALLOWEST on its path: deeper
branches are chance and sample-dependent, so routing on them would split sessions and make
sidecars disagree. It also counts family shares (contract 9c).
Bounds (docs/organic-routing.md "Bounded state"): every map keeps two generations, a full
one replacing the older in O(1) (no pause on the request path); ~8 MB at the defaults.
"""

from __future__ import annotations

# Routing contract 9: every sidecar of a fleet must hash the same blocks.
BLOCK_BYTES = 64  # vLLM's 16-token block at ~4 bytes per token (the emulator's exactly)
LEARN_BLOCKS = 128  # anchors are learnt in the first 8 KB of a prompt
MIN_FANOUT = 2
# Block keys per generation: a memory bound, not a tuned value (with the maps it sizes at
# most 82,176 entries, ~8 MB: docs/organic-routing.md "Bounded state").
MAX_BLOCKS = 32_768
SHARE_WINDOW = 4_096
# Shares count as if at least this many requests were seen, so a fresh sidecar's first
# request is not a family at 100 %.
SHARE_FLOOR = 100


class AnchorTable:
    """Branch points and family shares seen by one sidecar (never shared with another)."""

    def __init__(self, *, max_blocks: int = MAX_BLOCKS) -> None:
        if max_blocks < 16:
            raise ValueError(f"max_blocks is {max_blocks}; the table needs at least 16 entries")
        self.max_blocks = max_blocks
        self.max_fanout = max(8, max_blocks // 8)
        self.max_families = max(8, max_blocks // 8)
        # chain key -> its first successor's chain key (0: none seen yet), two generations.
        self._seen: dict[int, int] = {}
        self._seen_old: dict[int, int] = {}
        # branch point -> distinct successors (>= 2), two generations as `seen`.
        self._fanout: dict[int, int] = {}
        self._fanout_old: dict[int, int] = {}
        self._families: dict[int, int] = {}
        self._families_old: dict[int, int] = {}
        self._requests = 0
        self._requests_old = 0

    def __len__(self) -> int:
        """Entries held, all maps together: what the bound is about."""
        return sum(self.sizes().values())

    def sizes(self) -> dict[str, int]:
        """Entries per map, both generations: block keys remembered, branch points (an
        anchor is one with MIN_FANOUT successors), families counted."""
        return {
            "blocks": len(self._seen) + len(self._seen_old),
            "branch_points": len(self._fanout) + len(self._fanout_old),
            "families": len(self._families) + len(self._families_old),
        }

    @property
    def max_entries(self) -> int:
        """The bound: a generation of `seen` turns over after the prompt that fills it."""
        seen = 2 * (self.max_blocks + LEARN_BLOCKS)
        return seen + 2 * (self.max_fanout + self.max_families)

    def _successor(self, block: int) -> int | None:
        found = self._seen.get(block)
        return self._seen_old.get(block) if found is None else found

    def _known_depth(self, chain: list[int]) -> int:
        """How many leading blocks were seen before: a binary search, since a prompt's
        blocks are recorded from the first one on (eviction may blur it: an estimate)."""
        low, high = 0, len(chain)
        seen, old = self._seen, self._seen_old
        while low < high:
            middle = (low + high) >> 1
            block = chain[middle]
            if block in seen or block in old:
                low = middle + 1
            else:
                high = middle
        return low

    def learn(self, chain: list[int], learn_blocks: int = LEARN_BLOCKS) -> None:
        """Record one prompt's blocks (its first `learn_blocks`; `chain` may hold one more,
        whose key is the last learnt block's successor)."""
        learnt = min(len(chain), learn_blocks)
        known = self._known_depth(chain[:learnt])
        if known == learnt:
            return  # nothing new: a repeated prompt, or a prefix of an earlier one
        if known:
            parent = chain[known - 1]
            first = self._successor(parent)
            if not first:
                self._seen[parent] = chain[known]  # it had ended there: now it has a successor
            elif first != chain[known]:
                self._branch(parent)
        seen = self._seen
        last = len(chain) - 1
        for depth in range(known, learnt):
            seen[chain[depth]] = chain[depth + 1] if depth < last else 0
        if len(seen) >= self.max_blocks:
            self._seen_old = seen
            self._seen = {}

    def _branch(self, parent: int) -> None:
        fanout = self._fanout
        count = fanout.get(parent)
        if count is None:
            count = self._fanout_old.get(parent, 1)  # carried over: an anchor in use lives on
        fanout[parent] = count + 1
        if len(fanout) >= self.max_fanout:
            self._fanout_old = fanout  # O(1): no pause on the request path
            self._fanout = {}

    def anchor(self, chain: list[int]) -> int:
        """The depth of the shallowest anchor on the prompt's path, or -1 when it has none."""
        fanout, old, least = self._fanout, self._fanout_old, MIN_FANOUT
        for depth, block in enumerate(chain):
            count = fanout.get(block)
            if count is None:
                count = old.get(block)
            if count is not None and count >= least:
                return depth
        return -1

    def count(self, family: int) -> float:
        """Count one request of `family`; return the family's share of recent requests."""
        families = self._families
        families[family] = count = families.get(family, 0) + 1
        self._requests += 1
        seen = max(SHARE_FLOOR, self._requests + self._requests_old)
        share = (count + self._families_old.get(family, 0)) / seen
        if self._requests >= SHARE_WINDOW or len(families) >= self.max_families:
            self._families_old, self._requests_old = families, self._requests
            self._families, self._requests = {}, 0
        return share

    def fanout(self, block: int) -> int:
        """Distinct successors seen after `block` (0 or 1: not a branch point)."""
        count = self._fanout.get(block)
        return self._fanout_old.get(block, 0) if count is None else count
