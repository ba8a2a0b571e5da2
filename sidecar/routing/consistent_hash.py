"""consistent_hash: plain ring owner, no replicas and no load bound (the note's router,
with a good ring). Baseline: a hot prefix lands on one pod whatever its load.

Complexity: O(log P) (one bucket search in the Cython core).
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.membership.pool import RoutingTable


class ConsistentHash:
    name = "consistent_hash"

    def select(
        self,
        table: RoutingTable,
        key: int,
        replicas: int,
        factor: float,
        min_cap: int = 0,
        homes: Sequence[int] | None = None,
    ) -> tuple[str, str]:
        assert table.ring is not None
        return table.ring.owner(key), "ring_hit"
