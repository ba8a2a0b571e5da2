"""Budgeted home placement (routing contract section 6) over both twins' rings: its shape,
its independence of registration order, and that it only departs from the ring where the
ring would overfill a pod. The exact results are pinned by the golden vectors."""

from __future__ import annotations

from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.routing.placement import Placed, place

prefix_sets = st.lists(
    st.tuples(st.integers(0, (1 << 64) - 1), st.integers(1, 100), st.integers(1, 6)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    count=st.integers(1, 7),
    weights=st.lists(st.integers(1, 3), min_size=7, max_size=7),
    prefixes=prefix_sets,
    budget=st.integers(1, 400),
    seed=st.randoms(use_true_random=False),
)
def test_home_sets_are_well_formed_and_order_free(
    core: ModuleType,
    count: int,
    weights: list[int],
    prefixes: list[tuple[int, int, int]],
    budget: int,
    seed: object,
) -> None:
    ring = core.Ring([f"pod-{i}" for i in range(count)], weights[:count], vnodes=8)
    items = [Placed(k, t, r, f"id-{n}") for n, (k, t, r) in enumerate(prefixes)]
    homes = place(ring, items, budget)
    for item in items:
        home = [ring.members[i] for i in homes[item.id]]
        order = ring.preference(item.key, count)
        assert len(set(home)) == len(home) == min(item.replicas, count)
        assert home == [m for m in order if m in home], "homes keep preference order"
    shuffled = list(items)
    seed.shuffle(shuffled)  # type: ignore[attr-defined]
    assert place(ring, shuffled, budget) == homes


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(count=st.integers(1, 7), prefixes=prefix_sets)
def test_a_budget_that_never_binds_is_the_plain_ring(
    core: ModuleType, count: int, prefixes: list[tuple[int, int, int]]
) -> None:
    ring = core.Ring([f"pod-{i}" for i in range(count)], vnodes=8)
    items = [Placed(k, t, r, f"id-{n}") for n, (k, t, r) in enumerate(prefixes)]
    budget = sum(t * r for _, t, r in prefixes)
    homes = place(ring, items, budget)
    for item in items:
        assert [ring.members[i] for i in homes[item.id]] == ring.preference(item.key, item.replicas)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(count=st.integers(2, 7), sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30))
def test_no_pod_exceeds_the_budget_when_every_prefix_fits(
    core: ModuleType, count: int, sizes: list[int]
) -> None:
    """Single-replica prefixes and a budget with room for the largest two on every pod and
    for all of them together: first-fit decreasing always finds room, so no pod is over."""
    ring = core.Ring([f"pod-{i}" for i in range(count)], vnodes=8)
    items = [Placed(core.route_key(str(n).encode()), t, 1, str(n)) for n, t in enumerate(sizes)]
    budget = max(2 * max(sizes), -(-2 * sum(sizes) // count))
    homes = place(ring, items, budget)
    used = dict.fromkeys(ring.members, 0)
    for item in items:
        for i in homes[item.id]:
            used[ring.members[i]] += item.tokens
    assert max(used.values()) <= budget


@pytest.mark.parametrize("budget", [0, -5, True, 2.5])
def test_a_bad_budget_is_refused(core: ModuleType, budget: object) -> None:
    ring = core.Ring(["a", "b"], vnodes=4)
    with pytest.raises(ValueError, match="budget"):
        place(ring, [], budget)  # type: ignore[arg-type]


@pytest.mark.parametrize("balance", [0.5, -1.0, float("inf"), float("nan")])
def test_a_bad_balance_is_refused(core: ModuleType, balance: float) -> None:
    ring = core.Ring(["a", "b"], vnodes=4)
    with pytest.raises(ValueError, match="balance"):
        place(ring, [], 10, balance)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(count=st.integers(2, 7), sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30))
def test_balance_bounds_every_pod_when_the_items_are_small(
    core: ModuleType, count: int, sizes: list[int]
) -> None:
    """Single-replica prefixes no larger than (f - 1) x the fair share always find room under
    the balance bound (first-fit decreasing), so no pod ends above f x its fair share."""
    ring = core.Ring([f"pod-{i}" for i in range(count)], vnodes=8)
    items = [Placed(core.route_key(str(n).encode()), t, 1, str(n)) for n, t in enumerate(sizes)]
    fair = sum(sizes) / count
    balance = max(1.5, 1 + 2 * max(sizes) / fair)
    homes = place(ring, items, 10**9, balance)
    used = dict.fromkeys(ring.members, 0)
    for item in items:
        for i in homes[item.id]:
            used[ring.members[i]] += item.tokens
    assert max(used.values()) <= balance * fair + 1
