"""consistent_hash: plain ring owner, no replicas and no load bound (docs/mission.md's router,
with a good ring). Baseline: a hot prefix lands on one pod whatever its load.

Complexity: O(log P) (one bucket search in the Cython core).
"""

from __future__ import annotations

from prefix_sidecar.routing.pick import Branch, Pick
from prefix_sidecar.routing.table import RoutingTable


class ConsistentHash:
    def select(self, table: RoutingTable, pick: Pick) -> tuple[str, Branch]:
        assert table.ring is not None
        return table.ring.owner(pick.key), Branch.RING_HIT
