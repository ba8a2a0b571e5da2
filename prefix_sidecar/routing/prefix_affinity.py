"""prefix_affinity: the sidecar's policy, a bounded-load pick over a prefix's home set.

Routing contract v1 step 5 (`Ring.pick`): the least-loaded of the key's first R distinct
owners, spilling clockwise when it is above max(min_cap, ceil(c * (L+u) * w / W)), u the
request's cost; `min_cap` keeps a prefix on its warm home at low traffic. All in the pool's
load unit (routing/cost.py). With a KV budget the home set is the placement's (`Pick.homes`,
contract section 6; `Ring.pick_among`). Only this policy has bounded load's parameters.
Complexity: O(R) when a home fits (the pool keeps the loads' total), walking on only on a
spill; `select_bytes` hashes the prompt and picks in one core call.
"""

from __future__ import annotations

from prefix_sidecar.routing.cost import REQUEST_CAP_FLOOR, floor_units, pick_cost
from prefix_sidecar.routing.pick import Branch, Pick
from prefix_sidecar.routing.table import RoutingTable

# The core answers with the contract's plain strings; the same words as Branch members.
_BRANCHES = {str(b): b for b in (Branch.HOME, Branch.SPILL, Branch.FALLBACK)}


class PrefixAffinity:
    def __init__(
        self, load_factor: float, load_unit: str, floor_requests: int = REQUEST_CAP_FLOOR
    ) -> None:
        """`floor_requests`: the cap's floor in thin requests (a test may lower it)."""
        self.load_factor = load_factor  # c in the cap
        self.load_unit = load_unit
        self.load_cap_floor = floor_units(load_unit, floor_requests)  # min_cap

    def select(self, table: RoutingTable, pick: Pick) -> tuple[str, Branch]:
        ring = table.ring
        assert ring is not None
        key, replicas, homes, min_cap, prefill = pick
        floor = self.load_cap_floor if min_cap is None else min_cap
        cost = pick_cost(self.load_unit, prefill)
        if homes:
            member, branch = ring.pick_among(
                key, table.loads, homes, self.load_factor, floor, table.total, cost=cost
            )
        else:
            member, branch = ring.pick(
                key, table.loads, replicas, self.load_factor, floor, table.total, cost=cost
            )
        return member, _BRANCHES[branch]

    def select_bytes(
        self, table: RoutingTable, data: bytes, replicas: int, prefill: int = 0
    ) -> tuple[str, Branch, int]:
        """select() for the key of `data` (no budgeted homes), hashing and picking in one
        core call with the configured floor; returns (pod, branch, route key)."""
        ring = table.ring
        assert ring is not None
        member, branch, key = ring.pick_bytes(
            data,
            table.loads,
            replicas,
            self.load_factor,
            self.load_cap_floor,
            table.total,
            cost=pick_cost(self.load_unit, prefill),
        )
        return member, _BRANCHES[branch], key
