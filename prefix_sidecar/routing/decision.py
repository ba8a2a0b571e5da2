"""What the router answers: a `Decision` (the pod, the failover order, why), the error when
no pod can take a request, and the shape of the precise step that may move a decision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from prefix_sidecar import _core
from prefix_sidecar.prefixes import PrefixEntry
from prefix_sidecar.routing.pick import Branch
from prefix_sidecar.routing.scope import NO_SCOPE, Scope
from prefix_sidecar.routing.table import RoutingTable


class NoBackendError(Exception):
    """No pod can take the request (none known, or all ejected)."""


@dataclass(frozen=True)
class Decision:
    backend: str
    preference: list[str]
    prefix: PrefixEntry | None
    route_key: int
    branch: Branch
    decision_ns: int
    generation: int
    # The pod was the key's only home and took the request under its cap: no choice among
    # pods was made (the fleet view counts the other sidecars' requests for choices only).
    forced: bool = False
    # Its uncached prefill tokens on a pod warm with its prefix, estimated (routing/cost.py),
    # and the prefix's own, which a pod not warm with it computes too (upstream/relay.py).
    prefill: int = 0
    cold: int = 0
    homes: tuple[str, ...] = ()  # a registered prefix's home set (warm before they serve)


class PreciseStep(Protocol):
    """The request step that moves an organic decision (kv_events/precise.py)."""

    async def refine(
        self, decision: Decision, what: dict[str, Any], model: str = "", scope: Scope = NO_SCOPE
    ) -> Decision:
        """`decision` for an unregistered request whose text is `what`, in `scope` (its
        adapter and cache salt), perhaps moved; its decision_ns counts this step too."""


def serving_ring(table: RoutingTable) -> _core.HashTable:
    """The table's ring, or the error that says why there is none."""
    ring = table.ring
    if ring is None:
        raise NoBackendError(
            "no healthy vLLM pod: every backend is ejected or none is configured "
            "(check --backend / backends_file / backends_dns and the pods' health)"
        )
    return ring
