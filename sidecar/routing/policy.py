"""The policy interface, SGLang-router style: one policy per module, one shape, one factory.

A policy picks a pod from the current routing table for a route key and says which branch
decided, so tests can assert the branch and metrics can label by it. Policies other than
`prefix_affinity` exist as baselines for the benchmarks (same sidecar, same trace, only the
pick differs), not as recommendations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from sidecar.membership.pool import RoutingTable


class Policy(Protocol):
    name: str

    def select(
        self,
        table: RoutingTable,
        key: int,
        replicas: int,
        factor: float,
        min_cap: int = 0,
        homes: Sequence[int] | None = None,
    ) -> tuple[str, str]:
        """Return (pod url, branch). The table has at least one member.

        `factor` and `min_cap` are the bounded-load parameters of routing contract v1's pick
        (the cap and its floor); baselines that ignore load ignore them. `homes`, when
        given, is the prefix's budgeted home set (member indexes into `table.members`,
        routing contract section 6) to use instead of the ring's first `replicas` owners.
        """
        ...


POLICIES = ("prefix_affinity", "consistent_hash", "round_robin", "random", "least_loaded")


def make_policy(name: str, seed: int = 0) -> Policy:
    if name == "prefix_affinity":
        from sidecar.routing.prefix_affinity import PrefixAffinity

        return PrefixAffinity()
    if name == "consistent_hash":
        from sidecar.routing.consistent_hash import ConsistentHash

        return ConsistentHash()
    if name == "round_robin":
        from sidecar.routing.round_robin import RoundRobin

        return RoundRobin()
    if name == "random":
        from sidecar.routing.random_pick import RandomPick

        return RandomPick(seed)
    if name == "least_loaded":
        from sidecar.routing.least_loaded import LeastLoaded

        return LeastLoaded()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
