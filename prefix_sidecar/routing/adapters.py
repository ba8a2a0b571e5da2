"""A request for a LoRA adapter goes to a pod that holds it (issue 30).

Pods load adapters at start (`--lora-modules`) or at run time (`/v1/load_lora_adapter`),
and need not all hold the same ones; each pool learns which pod holds which from the pods'
own /v1/models (membership/adapters.py). A request whose model is an adapter keeps its pick
when that pod holds it, else takes the first pod of its preference order (its home set
first) that holds it and fits under its bounded-load cap, else the first member from its
key's start that does, else the least-loaded holder: a pod without the adapter would answer
vLLM's 404, so a holder over its cap beats it. Its failover order puts the holders first.

Complexity: one set lookup when the pick holds the adapter; otherwise the members in the
key's order once, one policy pick per holder met, stopping at the first that fits.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from prefix_sidecar import _core
from prefix_sidecar.prefixes import PrefixEntry
from prefix_sidecar.routing.decision import Decision
from prefix_sidecar.routing.pick import Branch, Pick
from prefix_sidecar.routing.policy import Policy
from prefix_sidecar.routing.scope import Scope
from prefix_sidecar.routing.table import RoutingTable


class AdapterView(Protocol):
    """Which pod holds which adapter (membership/adapters.py)."""

    def holds(self, pod: str, adapter: str) -> bool: ...


def to_adapter_holder(
    policy: Policy, table: RoutingTable, decision: Decision, scope: Scope, view: AdapterView
) -> Decision:
    """`decision` when its pod holds the request's adapter; else moved (branch ADAPTER) to
    the first pod of its preference order (home set first) that holds it and fits under its
    cap, else the first member from the key's start that does, else the least-loaded
    holder; its failover order then the other holders in order, then the rest. With no
    holder known, `decision` unchanged."""
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
    chosen = min(holders, key=lambda pod: table.loads[table.index[pod]])
    for pod in holders:
        # The baselines never answer HOME: the least-loaded holder then.
        _, branch = policy.select(table, Pick(key, 1, (table.index[pod],)))
        if branch is Branch.HOME:
            chosen = pod
            break
    rest = [pod for pod in order if pod != chosen]
    held = [pod for pod in rest if view.holds(pod, adapter)]
    preference = [chosen, *held, *(pod for pod in rest if pod not in held)]
    return replace(decision, backend=chosen, preference=preference, branch=Branch.ADAPTER)


def holder_homes(
    ring: _core.HashTable, entry: PrefixEntry, replicas: int, view: AdapterView
) -> list[str]:
    """A prefix registered for an adapter lives on the first `replicas` pods of its key's
    preference order that hold the adapter (where `to_adapter_holder` sends its requests
    while they fit): its prewarm goes there. No holder known: the ring's homes."""
    adapter = entry.scope.adapter
    order = ring.preference(entry.route_key, len(ring.members))
    held = [pod for pod in order if view.holds(pod, adapter)]
    return held[:replicas] if held else order[:replicas]
