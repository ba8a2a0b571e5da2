"""The routing snapshot every policy picks from: the hash table over serving pods, their loads.

Its own module, imported by the pool that builds it and the policies that read it, so that
routing never imports membership (the pool is a writer, not a dependency of a pick).
"""

from __future__ import annotations

import array
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
