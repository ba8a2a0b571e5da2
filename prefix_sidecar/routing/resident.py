"""Routing on residency (kv_events=true, issue 29): a registered prefix's picked pod is
known to have lost it (vLLM evicted it, the pod restarted), so another home that holds it
takes the request, as long as it fits under its bounded-load cap.

Algorithm: if `holds(picked)` is False, the first pod of the home set, in the home set's own
order, with `holds(pod)` True and a HOME answer from the policy for a one-pod home set (under
its cap). Sidecars that heard the same events pick the same pod. Unknown (None) keeps the
hash's pick, as does a prefix no home holds any more: it must be rebuilt somewhere, and its
hash home is where every sidecar sends it.

Complexity: one `holds` (O(blocks of the prefix)) per request; only when the pick lost the
prefix, up to R more and a policy pick each.

The residency is passed in (`ResidencyView`): routing never imports kv_events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prefix_sidecar.routing.pick import Branch, Pick
from prefix_sidecar.routing.policy import Policy
from prefix_sidecar.routing.table import RoutingTable


class ResidencyView(Protocol):
    """Where registered prefixes live, from the pods' KV events (kv_events/residency.py)."""

    def holds(self, pod: str, prefix_id: str) -> bool | None:
        """Whether `pod` holds the prefix's whole blocks; None: unknown."""


def to_resident(
    policy: Policy,
    table: RoutingTable,
    key: int,
    home_set: Sequence[str],
    prefix_id: str,
    picked: str,
    residency: ResidencyView,
) -> str:
    """`picked`, or the first pod of `home_set` that holds the prefix and fits, when `picked`
    is known not to hold it."""
    holds = residency.holds
    if holds(picked, prefix_id) is not False:
        return picked
    for pod in home_set:
        index = table.index.get(pod)
        if pod != picked and index is not None and holds(pod, prefix_id):
            # The baselines never answer HOME: they keep their own pick.
            _, branch = policy.select(table, Pick(key, 1, (index,)))
            if branch is Branch.HOME:
                return pod
    return picked
