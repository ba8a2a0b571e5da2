"""prefix_affinity: the sidecar's policy - bounded-load pick over a prefix's replica set.

Algorithm: routing contract v1, step 5 (`Ring.pick`): the least-loaded of the first R
distinct owners of the key, spilling clockwise when it is above
max(min_cap, ceil(c * (L+1) * w / W)); the floor `min_cap` (config `load_cap_floor`) keeps a
prefix on its warm home pod while few requests are in flight. With a KV budget
(config `home_kv_budget_tokens`) the home set is the budgeted placement's (`homes`, contract
section 6) instead of the first R owners, and `Ring.pick_among` does the same pick over it.
Complexity: O(N) for the load sum plus the walk; ~100 ns in the Cython core at 100 pods.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.membership.pool import RoutingTable


class PrefixAffinity:
    name = "prefix_affinity"

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
        if homes:
            return table.ring.pick_among(key, table.loads, homes, factor, min_cap)
        return table.ring.pick(key, table.loads, replicas, factor, min_cap)
