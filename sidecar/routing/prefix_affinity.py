"""prefix_affinity: the sidecar's policy - bounded-load pick over a prefix's replica set.

Algorithm: routing contract v1, step 5 (`Ring.pick`): the least-loaded of the first R
distinct owners of the key, spilling clockwise when it is above ceil(c * (L+1) * w / W).
Complexity: O(N) for the load sum plus the walk; ~100 ns in the Cython core at 100 pods.
"""

from __future__ import annotations

from sidecar.membership.pool import RoutingTable


class PrefixAffinity:
    name = "prefix_affinity"

    def select(
        self, table: RoutingTable, key: int, replicas: int, factor: float
    ) -> tuple[str, str]:
        assert table.ring is not None
        return table.ring.pick(key, table.loads, replicas, factor)
