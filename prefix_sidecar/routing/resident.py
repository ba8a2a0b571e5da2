"""Routing on residency (kv_events on): a registered prefix's pick known to have lost the
prefix (evicted, pod restarted) yields to another home that holds it and fits its cap.

Unknown residency (None) keeps the hash pick, as does a prefix no home holds: it must be
rebuilt, and its hash home is where every sidecar sends it. Residency is passed in
(`ResidencyView`) so routing never imports kv_events. Complexity: one `holds` (O(prefix
blocks)) per request; up to R more, each with a policy pick, only when the pick lost it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prefix_sidecar.routing.policy import Policy, first_home
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
    """`picked`, unless known not to hold the prefix: then the first other pod of `home_set`
    (in its order) that holds it and gets HOME as a one-pod home set (fits its cap).
    Sidecars that heard the same events pick the same pod."""
    holds = residency.holds
    if holds(picked, prefix_id) is not False:
        return picked
    # Lazily: `holds` only up to the first that fits.
    others = (
        pod for pod in home_set if pod != picked and pod in table.index and holds(pod, prefix_id)
    )
    moved = first_home(policy, table, key, others)
    return picked if moved is None else moved  # the baselines keep their own pick
