"""Budgeted home placement (routing contract section 6) over both twins' rings: its shape,
its independence of registration order, and that it only departs from the ring where the
ring would overfill a pod. The exact results are pinned by the golden vectors (tests/core).

Then the sidecar's HomePlacer: built when the pool swaps its ring or a prefix is registered
or unregistered, never by a request (a running sidecar: tests/server/grpc/test_placement.py).
"""

from __future__ import annotations

from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_sidecar import _core
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.membership.sources import Member
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.routing.placement import HomePlacer, Placed, place

from .conftest import MakeRouter, pods, serving_pool

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


# --- HomePlacer ------------------------------------------------------------------------

TOKENS = 1_000  # each prefix: 4,000 bytes, 1,000 tokens at the default 4 bytes per token


def texts(count: int) -> list[str]:
    return [f"rules {i} ".ljust(4 * TOKENS, "x") for i in range(count)]


def expected_homes(ring: _core.HashTable, store: PrefixStore, budget: int) -> dict[str, list[str]]:
    """What place() says for the store's whole registered set, as member urls."""
    items = [Placed(e.route_key, TOKENS, e.replicas or 1, e.id) for e in store]
    return {
        prefix_id: [ring.members[m] for m in homes]
        for prefix_id, homes in place(ring, items, budget).items()
    }


def test_a_registration_places_at_once_and_requests_only_look_up(
    make_router: MakeRouter,
) -> None:
    pool, store = serving_pool(pods(4)), PrefixStore()
    router = make_router(pool, store, home_kv_budget_tokens=3 * TOKENS)
    placer = router.placer
    entries = [store.register(f"p{i}", text)[0] for i, text in enumerate(texts(12))]
    assert placer.builds == 1 + 12  # at start, then once per registration (one ring)
    for _ in range(3):
        for entry in entries:
            decision = router.for_prefix(entry)
            assert decision.preference[0] == decision.backend
    assert placer.builds == 13, "a request must not compute a placement"
    ring = pool.table.ring
    assert ring is not None
    want = expected_homes(ring, store, 3 * TOKENS)
    assert {e.id: router.home_set(e) for e in entries} == want

    store.unregister_name("p0")
    assert placer.builds == 14
    want = expected_homes(ring, store, 3 * TOKENS)
    assert {e.id: router.home_set(e) for e in entries[1:]} == want
    store.register("p1", texts(12)[1], replicas=2)  # a new replica count re-places too
    assert placer.builds == 15
    assert len(router.home_set(entries[1])) == 2


def test_a_ring_change_places_again_on_the_new_ring(make_router: MakeRouter) -> None:
    urls = pods(4)
    pool, store = serving_pool(urls), PrefixStore()
    router = make_router(pool, store, home_kv_budget_tokens=3 * TOKENS)
    entries = [store.register(f"p{i}", text)[0] for i, text in enumerate(texts(8))]
    builds = router.placer.builds
    pool.set_health(urls[0], False)  # ejected: a new ring without it
    assert router.placer.builds == builds + 1
    ring = pool.table.ring
    assert ring is not None and urls[0] not in ring.members
    want = expected_homes(ring, store, 3 * TOKENS)
    for entry in entries:
        decision = router.for_prefix(entry)
        assert decision.backend == want[entry.id][0]
        assert router.home_set(entry) == want[entry.id]
    assert router.placer.builds == builds + 1


def test_a_warming_pod_gets_a_target_placement_of_its_own(make_router: MakeRouter) -> None:
    """While a pod warms the target ring (prewarm targets) differs from the routing ring:
    both are placed when the pool changes; once it serves, one ring and one placement."""
    urls = pods(3)
    joining: list[str] = []
    pool = BackendPool(needs_warming=lambda: True, on_warm_needed=joining.append)
    pool.set_members([Member(url, 1) for url in urls[:2]])
    for url in urls[:2]:
        pool.set_health(url, True)
        pool.mark_warm(url)
    store = PrefixStore()
    router = make_router(pool, store, home_kv_budget_tokens=3 * TOKENS)
    entry = store.register("p", texts(1)[0])[0]
    pool.set_members([Member(url, 1) for url in urls])
    builds = router.placer.builds
    pool.set_health(urls[2], True)  # healthy, warming: on the target ring only
    assert joining[-1] == urls[2]
    assert pool.target_ring() is not pool.table.ring
    assert router.placer.builds == builds + 2
    target = pool.target_ring()
    assert target is not None and urls[2] in target.members
    assert router.home_set(entry) == expected_homes(target, store, 3 * TOKENS)[entry.id]
    pool.mark_warm(urls[2])
    assert pool.target_ring() is pool.table.ring
    assert router.placer.builds == builds + 3


def test_a_ring_it_was_not_told_of_is_placed_on_first_use(core: ModuleType) -> None:
    store = PrefixStore()
    entries = [store.register(f"p{i}", text)[0] for i, text in enumerate(texts(6))]
    placer = HomePlacer(
        store, lambda e: 1, budget_tokens=2 * TOKENS, bytes_per_token=4.0, balance=0.0
    )
    ring = core.Ring(pods(3), vnodes=16)
    want = expected_homes(ring, store, 2 * TOKENS)
    for entry in entries:
        homes = placer.homes(ring, entry)
        assert homes is not None
        assert list(homes.order[: len(homes.indexes)]) == want[entry.id]
        assert sorted(homes.order) == sorted(ring.members)
    assert placer.builds == 1


def test_without_a_budget_nothing_is_placed(make_router: MakeRouter) -> None:
    pool, store = serving_pool(pods(3)), PrefixStore()
    router = make_router(pool, store)
    entry = store.register("p", texts(1)[0], replicas=2)[0]
    ring = pool.table.ring
    assert ring is not None
    assert router.placer.homes(ring, entry) is None
    assert router.home_set(entry) == ring.preference(entry.route_key, 2)
    assert router.placer.builds == 0
