"""Send a LoRA adapter's request to a pod that holds the adapter.

Pods need not hold the same adapters; the pool learns who holds what from the pods' own
/v1/models (membership/adapters.py). A pod without the adapter answers vLLM's 404, so a
holder over its cap still beats it. Complexity: one set lookup when the pick holds the
adapter; else one pass over the key's members, one policy pick per holder until one fits.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from prefix_sidecar import _core
from prefix_sidecar.prefixes import PrefixEntry
from prefix_sidecar.routing.decision import Decision
from prefix_sidecar.routing.pick import Branch
from prefix_sidecar.routing.policy import Policy, first_home
from prefix_sidecar.routing.scope import Scope
from prefix_sidecar.routing.table import RoutingTable


class AdapterView(Protocol):
    """Which pod holds which adapter (membership/adapters.py)."""

    def holds(self, pod: str, adapter: str) -> bool: ...


def to_adapter_holder(
    policy: Policy, table: RoutingTable, decision: Decision, scope: Scope, view: AdapterView
) -> Decision:
    """`decision` if its pod holds the adapter or no holder is known; else moved (branch
    ADAPTER) to the first holder that fits its cap, in the decision's order (home set first)
    then the key's ring order, else the least-loaded holder. Failover: the chosen pod, then
    the decision's order with holders first."""
    adapter, key, order = scope.adapter, decision.route_key, decision.preference
    if view.holds(decision.backend, adapter):
        return decision
    members = table.ring.preference(key, len(table.members)) if table.ring is not None else []
    seen = set(order)
    holders = [
        p for p in (*order, *(m for m in members if m not in seen)) if view.holds(p, adapter)
    ]
    if not holders:
        return decision
    chosen = first_home(policy, table, key, holders)
    if chosen is None:  # the baselines never answer HOME: the least-loaded holder then
        chosen = min(holders, key=lambda pod: table.loads[table.index[pod]])
    rest = [pod for pod in order if pod != chosen]
    held = [pod for pod in rest if view.holds(pod, adapter)]
    preference = [chosen, *held, *(pod for pod in rest if pod not in held)]
    return replace(decision, backend=chosen, preference=preference, branch=Branch.ADAPTER)


def holder_homes(
    ring: _core.HashTable, entry: PrefixEntry, replicas: int, view: AdapterView
) -> list[str]:
    """Where an adapter's registered prefix is prewarmed: the first `replicas` holders in
    its key's preference order (where `to_adapter_holder` sends it while they fit), else the
    ring's homes when no holder is known."""
    adapter = entry.scope.adapter
    order = ring.preference(entry.route_key, len(ring.members))
    held = [pod for pod in order if view.holds(pod, adapter)]
    return held[:replicas] if held else order[:replicas]
