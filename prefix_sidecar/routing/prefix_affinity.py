"""prefix_affinity: the sidecar's policy - bounded-load pick over a prefix's home set.

Algorithm: routing contract v1, step 5 (`Ring.pick`): the least-loaded of the first R
distinct owners of the key, spilling clockwise when it is above
max(min_cap, ceil(c * (L+u) * w / W)), u the request's cost; the floor `min_cap` keeps a
prefix on its warm home pod while few requests are in flight. Loads, the cost and the floor
are in the pool's load unit (config load_unit, routing/cost.py): requests, or tokens. With a
KV budget (config `home_kv_budget_tokens`) the home set is the budgeted placement's (`Pick.homes`,
contract section 6) instead of the first R owners, and `Ring.pick_among` does the same pick
over it.

Bounded load belongs to this policy alone, so it holds the two parameters; the baselines
never see them. (Envoy wraps any hashing picker in bounded load; here the contract defines
one hashing picker, the ring's replica set, and the core does the set and the spill walk in
one call, so the wrapper and the picker are one class.)

Complexity: the pool keeps the loads' total (`RoutingTable.total`), so a pick reads only the
home set's loads when a home fits, O(R), and walks on only when it spills; it does not grow
with the fleet. `select_bytes` hashes the prompt's bytes and picks in one core call.
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
