"""prefix_affinity: the sidecar's policy - bounded-load pick over a prefix's replica set.

Algorithm: routing contract v1, step 5 (`Ring.pick`): the least-loaded of the first R
distinct owners of the key, spilling clockwise when it is above
max(min_cap, ceil(c * (L+1) * w / W)); the floor `min_cap` (config `load_cap_floor`) keeps a
prefix on its warm home pod while few requests are in flight.
Complexity: O(N) for the load sum plus the walk; ~100 ns in the Cython core at 100 pods.
"""

from __future__ import annotations

from sidecar.membership.pool import RoutingTable


class PrefixAffinity:
    name = "prefix_affinity"

    def select(
        self, table: RoutingTable, key: int, replicas: int, factor: float, min_cap: int = 0
    ) -> tuple[str, str]:
        assert table.ring is not None
        return table.ring.pick(key, table.loads, replicas, factor, min_cap)
