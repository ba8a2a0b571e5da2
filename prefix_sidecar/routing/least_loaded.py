"""least_loaded: the pod with the fewest in-flight requests (ties: ring member order),
ignoring the key. Baseline: balances load, loses prefix locality.

Complexity: O(N).
"""

from __future__ import annotations

from prefix_sidecar.routing.pick import Branch, Pick
from prefix_sidecar.routing.table import RoutingTable


class LeastLoaded:
    ignores_key = True  # the router computes no organic keys for it

    def select(self, table: RoutingTable, pick: Pick) -> tuple[str, Branch]:
        loads = table.loads
        best = min(range(len(loads)), key=loads.__getitem__)
        return table.members[best], Branch.LEAST_LOADED
