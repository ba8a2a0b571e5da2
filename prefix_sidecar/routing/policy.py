"""The policy interface and its registry: one policy per module, one shape, one factory.

A policy picks a pod for a `Pick` and names the `Branch` that decided (tests assert it,
metrics label by it). Policies other than `prefix_affinity` are benchmark baselines (same
sidecar and trace, only the pick differs), not recommendations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from prefix_sidecar.routing.consistent_hash import ConsistentHash
from prefix_sidecar.routing.least_loaded import LeastLoaded
from prefix_sidecar.routing.pick import Branch, Pick
from prefix_sidecar.routing.policy_names import POLICIES
from prefix_sidecar.routing.prefix_affinity import PrefixAffinity
from prefix_sidecar.routing.random_pick import RandomPick
from prefix_sidecar.routing.round_robin import RoundRobin
from prefix_sidecar.routing.table import RoutingTable


class Policy(Protocol):
    def select(self, table: RoutingTable, pick: Pick) -> tuple[str, Branch]:
        """Return (pod url, branch). The table has at least one member."""
        ...


def first_home(
    policy: Policy,
    table: RoutingTable,
    key: int,
    pods: Iterable[str],
    min_cap: int | None = None,
    prefill: Callable[[str], int] = lambda pod: 0,
) -> str | None:
    """The first of `pods` in `table` the policy answers HOME for as a one-pod home set
    (under its cap, weighed with `prefill(pod)`); None if none (baselines never answer HOME)."""
    for pod in pods:
        index = table.index.get(pod)
        if index is None:
            continue
        _, branch = policy.select(table, Pick(key, 1, (index,), min_cap, prefill(pod)))
        if branch is Branch.HOME:
            return pod
    return None


class PolicySettings(Protocol):
    """What a policy may be built from: prefix_sidecar.config.Config's fields of these names."""

    @property
    def load_factor(self) -> float: ...

    @property
    def load_unit(self) -> str: ...


# Each name of policy_names.POLICIES with its factory (config validation reads the names).
_REGISTRY: dict[str, Callable[[PolicySettings], Policy]] = {
    "prefix_affinity": lambda s: PrefixAffinity(s.load_factor, s.load_unit),
    "consistent_hash": lambda _s: ConsistentHash(),
    "round_robin": lambda _s: RoundRobin(),
    "random": lambda _s: RandomPick(),
    "least_loaded": lambda _s: LeastLoaded(),
}
assert tuple(_REGISTRY) == POLICIES, "policy_names.POLICIES lists every policy, in order"


def make_policy(name: str, settings: PolicySettings) -> Policy:
    """The named policy, given only the settings it uses."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return factory(settings)
