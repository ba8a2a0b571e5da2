"""The routing snapshot every policy picks from: the hash table over serving pods, their loads.

Its own module, imported by the pool that builds it and the policies that read it, so that
routing never imports membership (the pool is a writer, not a dependency of a pick).
"""

from __future__ import annotations

import array
import math
from dataclasses import dataclass

from prefix_sidecar import _core


@dataclass(slots=True)
class RoutingTable:
    """One routing snapshot. Only the pool mutates it, and only `loads` (each member's
    effective load, aligned with `members`) and `total`, which is always sum(loads)."""

    ring: _core.HashTable | None  # a Ring or a Maglev table (config hash_table)
    index: dict[str, int]
    loads: array.array[int]
    generation: int
    total: int = 0

    @property
    def members(self) -> tuple[str, ...]:
        return self.ring.members if self.ring is not None else ()

    def over_cap_load(self, url: str, load_factor: float, cap_floor: int) -> int | None:
        """The smallest load that puts `url` over its bounded-load cap (routing contract
        section 4) on this table, counting that the report itself joins the total:
        v with v + 1 > max(min_cap, ceil(c (L - e + v + 1) s)), e being the pod's load in the
        table and s its weight share; the smallest, so that the others' caps grow least.
        None when no load can (c s >= 1: one pod, or c >= the pod count)."""
        index = self.index.get(url)
        if index is None or self.ring is None:
            return None
        share = load_factor * float(self.ring.weights[index]) / float(self.ring.total_weight)
        if share >= 1.0:
            return None
        others = self.total - self.loads[index] + 1
        return max(cap_floor, math.ceil(share * others / (1.0 - share)))
