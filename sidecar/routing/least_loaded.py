"""least_loaded: the pod with the fewest in-flight requests (ties: ring member order),
ignoring the key. Baseline: balances load, loses prefix locality.

Complexity: O(N).
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.membership.pool import RoutingTable


class LeastLoaded:
    name = "least_loaded"

    def select(
        self,
        table: RoutingTable,
        key: int,
        replicas: int,
        factor: float,
        min_cap: int = 0,
        homes: Sequence[int] | None = None,
    ) -> tuple[str, str]:
        loads = table.loads
        best = min(range(len(loads)), key=loads.__getitem__)
        return table.members[best], "least_loaded"
