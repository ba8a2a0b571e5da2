"""Routing on residency (routing/resident.py): a registered prefix's pick that is known to have
lost it goes to the first home that holds it and fits; unknown or lost everywhere keeps the
hash's pick. The residency is a fake: a dict of what each pod holds."""

from __future__ import annotations

from prefix_sidecar.prefixes import PrefixStore

from .conftest import MakeRouter, pods, serving_pool

RULES = "Refunds go back to the original payment method within 14 days. " * 30


class FakeResidency:
    def __init__(self) -> None:
        self.held: dict[str, set[str]] = {}  # pod -> prefix ids; a pod missing is unknown

    def holds(self, pod: str, prefix_id: str) -> bool | None:
        held = self.held.get(pod)
        return None if held is None else prefix_id in held


def test_a_home_known_to_have_lost_the_prefix_sends_it_to_the_home_that_holds_it(
    make_router: MakeRouter,
) -> None:
    urls = pods(6)
    pool, store = serving_pool(urls), PrefixStore()
    router = make_router(pool, store, cap_floor=4)
    entry = store.register("rules", RULES, replicas=3)[0]
    homes = router.home_set(entry)
    picked = router.for_prefix(entry).backend
    residency = FakeResidency()
    router.residency = residency

    # Unknown everywhere: the hash's pick.
    assert router.for_prefix(entry).backend == picked
    # Known on the pick and holding it: the same.
    residency.held = {url: {entry.id} for url in urls}
    assert router.for_prefix(entry).backend == picked
    # The pick lost it: the first other home, in the home set's order, that holds it.
    others = [url for url in homes if url != picked]
    residency.held[picked] = set()
    decision = router.for_prefix(entry)
    assert decision.backend == others[0] and decision.preference[0] == others[0]
    residency.held[others[0]] = set()
    assert router.for_prefix(entry).backend == others[1]
    # The one holding it is over its cap: the hash's pick stands.
    for _ in range(10):
        pool.acquire(others[1])
    assert router.for_prefix(entry).backend == picked
    for _ in range(10):
        pool.release(others[1])
    # Unknown there: not taken as holding it.
    del residency.held[others[1]]
    assert router.for_prefix(entry).backend == picked
    # A pod outside the home set that holds it is no home: lost by every home, the hash.
    outside = next(url for url in urls if url not in homes)
    residency.held = {url: set() for url in urls}
    residency.held[outside] = {entry.id}
    assert router.for_prefix(entry).backend == picked


def test_every_router_with_the_same_residency_picks_the_same_pod(
    make_router: MakeRouter,
) -> None:
    """Deterministic: the home set's order decides, not a pod's name or a dict's order."""
    urls = pods(5)
    chosen = set()
    for order in (urls, urls[::-1]):
        pool, store = serving_pool(order), PrefixStore()
        router = make_router(pool, store, cap_floor=4)
        entry = store.register("rules", RULES, replicas=3)[0]
        homes = router.home_set(entry)
        residency = FakeResidency()
        residency.held = {url: {entry.id} for url in homes[1:]}
        residency.held[homes[0]] = set()
        router.residency = residency
        chosen.add(router.for_prefix(entry).backend)
        assert router.for_prefix(entry).backend == homes[1]
    assert len(chosen) == 1


def test_the_baselines_keep_their_own_pick(make_router: MakeRouter) -> None:
    urls = pods(4)
    pool, store = serving_pool(urls), PrefixStore()
    router = make_router(pool, store, policy="consistent_hash")
    entry = store.register("rules", RULES, replicas=2)[0]
    picked = router.for_prefix(entry).backend
    residency = FakeResidency()
    residency.held = {url: {entry.id} for url in urls}
    residency.held[picked] = set()
    router.residency = residency
    assert router.for_prefix(entry).backend == picked
