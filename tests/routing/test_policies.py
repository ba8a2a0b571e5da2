"""The policies, one shape: select(table, Pick) -> (pod, Branch), from one registry.

prefix_affinity must answer exactly what the core's bounded-load pick answers (the routing
contract's results, to the bit); the baselines ignore load settings they never receive."""

from __future__ import annotations

import array
from types import ModuleType, SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_sidecar.config import build_config
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.routing.consistent_hash import ConsistentHash
from prefix_sidecar.routing.cost import DECODE_TOKENS
from prefix_sidecar.routing.least_loaded import LeastLoaded
from prefix_sidecar.routing.pick import Branch, Pick
from prefix_sidecar.routing.policy import POLICIES, make_policy
from prefix_sidecar.routing.prefix_affinity import PrefixAffinity
from prefix_sidecar.routing.random_pick import RandomPick
from prefix_sidecar.routing.round_robin import RoundRobin
from prefix_sidecar.routing.router import DEFAULT_POLICY, Router
from prefix_sidecar.routing.table import RoutingTable

from .conftest import pods


def table(ring: object, loads: list[int]) -> RoutingTable:
    members = ring.members  # type: ignore[attr-defined]
    index = {url: i for i, url in enumerate(members)}
    return RoutingTable(ring, index, array.array("q", loads), 1, sum(loads))  # type: ignore[arg-type]


def test_branch_values_are_the_wire_and_metric_words() -> None:
    assert [str(b) for b in Branch] == [
        "home",
        "spill",
        "fallback",
        "cached",
        "emptiest",
        "quickest",
        "stayed",
        "adapter",
        "ring_hit",
        "round_robin",
        "random",
        "least_loaded",
    ]
    assert Branch.HOME == "home" and f"{Branch.SPILL}" == "spill"
    assert "branch=%s" % Branch.RING_HIT == "branch=ring_hit"  # noqa: UP031 - the log's form


def test_one_registry_names_every_policy_for_the_factory_and_the_router() -> None:
    assert POLICIES == (
        "prefix_affinity",
        "consistent_hash",
        "round_robin",
        "random",
        "least_loaded",
    )
    config = build_config({})
    kinds = [type(make_policy(name, config)) for name in POLICIES]
    assert kinds == [PrefixAffinity, ConsistentHash, RoundRobin, RandomPick, LeastLoaded]
    with pytest.raises(ValueError, match="unknown routing policy 'nope'; choose one of prefix_"):
        make_policy("nope", config)
    # Production picks prefix_affinity; a benchmark names a baseline (no config field).
    assert DEFAULT_POLICY == "prefix_affinity"
    router = Router.from_config(BackendPool(), PrefixStore(), config)
    assert isinstance(router.policy, PrefixAffinity)
    baseline = Router.from_config(BackendPool(), PrefixStore(), config, "round_robin")
    assert isinstance(baseline.policy, RoundRobin)
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        Router.from_config(BackendPool(), PrefixStore(), config, "nope")


def test_bounded_load_settings_reach_prefix_affinity_only() -> None:
    policy = make_policy("prefix_affinity", SimpleNamespace(load_factor=1.5, load_unit="requests"))
    assert isinstance(policy, PrefixAffinity)
    assert (policy.load_factor, policy.load_unit, policy.load_cap_floor) == (1.5, "requests", 8)
    config = build_config({})
    default = make_policy("prefix_affinity", config)
    assert isinstance(default, PrefixAffinity)
    # The config's defaults: c 1.25, load in tokens, a floor of 8 thin requests.
    assert (default.load_factor, default.load_unit) == (1.25, "tokens")
    assert default.load_cap_floor == 8 * DECODE_TOKENS


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    count=st.integers(1, 8),
    key=st.integers(0, (1 << 64) - 1),
    loads=st.lists(st.integers(0, 40), min_size=8, max_size=8),
    replicas=st.integers(1, 5),
    factor=st.sampled_from([1.0, 1.1, 1.25, 2.0]),
    floor=st.integers(0, 10),
    homes=st.none() | st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True),
)
def test_prefix_affinity_is_the_cores_bounded_load_pick(
    core: ModuleType,
    count: int,
    key: int,
    loads: list[int],
    replicas: int,
    factor: float,
    floor: int,
    homes: list[int] | None,
) -> None:
    ring = core.Ring(pods(count), vnodes=8)
    snapshot = table(ring, loads[:count])
    home_set = tuple(m for m in homes if m < count) if homes is not None else None
    policy = PrefixAffinity(factor, "requests", floor)
    got = policy.select(snapshot, Pick(key, replicas, home_set or None))
    if home_set:
        want = ring.pick_among(key, snapshot.loads, home_set, factor, floor)
    else:
        want = ring.pick(key, snapshot.loads, replicas, factor, floor)
    assert got == want
    assert type(got[1]) is Branch


def test_consistent_hash_is_the_ring_owner_whatever_the_load(core: ModuleType) -> None:
    ring = core.Ring(pods(5), vnodes=16)
    snapshot = table(ring, [100, 0, 0, 0, 0])
    for key in range(0, 1 << 64, (1 << 64) // 50):
        assert ConsistentHash().select(snapshot, Pick(key, 3, None)) == (
            ring.owner(key),
            Branch.RING_HIT,
        )


def test_round_robin_takes_each_pod_in_turn(core: ModuleType) -> None:
    ring = core.Ring(pods(3), vnodes=8)
    policy = RoundRobin()
    picks = [policy.select(table(ring, [0, 0, 0]), Pick(7, 1, None)) for _ in range(6)]
    assert picks == [(m, Branch.ROUND_ROBIN) for m in ring.members * 2]


def test_random_is_uniform_over_the_pods_and_seeded(core: ModuleType) -> None:
    ring = core.Ring(pods(4), vnodes=8)
    snapshot = table(ring, [0] * 4)
    first = [RandomPick(seed=3).select(snapshot, Pick(k, 1, None)) for k in range(400)]
    again = [RandomPick(seed=3).select(snapshot, Pick(k, 1, None)) for k in range(400)]
    assert first == again
    policy = RandomPick(seed=3)
    picks = [policy.select(snapshot, Pick(1, 1, None)) for _ in range(400)]
    assert {branch for _, branch in picks} == {Branch.RANDOM}
    assert {member for member, _ in picks} == set(ring.members)


def test_least_loaded_takes_the_idlest_pod_first_in_member_order(core: ModuleType) -> None:
    ring = core.Ring(pods(4), vnodes=8)
    members = ring.members
    assert LeastLoaded().select(table(ring, [3, 1, 2, 1]), Pick(9, 1, None)) == (
        members[1],
        Branch.LEAST_LOADED,
    )
    assert LeastLoaded().select(table(ring, [0, 0, 0, 0]), Pick(9, 1, None))[0] == members[0]


@pytest.mark.parametrize("kind", ["ring", "maglev"])
def test_prefix_affinity_select_bytes_is_select_of_the_key(core: ModuleType, kind: str) -> None:
    ring = core.make_table(kind, pods(9), None, 16)
    policy = PrefixAffinity(1.25, "requests", 2)
    for n in range(50):
        loads = [(n * 7 + i * 3) % 6 for i in range(9)]
        snapshot = table(ring, loads)
        data = f"prompt {n}".encode()
        key = core.route_key(data)
        member, branch = policy.select(snapshot, Pick(key, 2, None))
        assert policy.select_bytes(snapshot, data, 2) == (member, branch, key)
