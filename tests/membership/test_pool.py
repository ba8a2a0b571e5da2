"""The backend pool: which pods are on the routing ring and the target ring, one ring when
they are the same pods, and the watchers that hear of every new table."""

from __future__ import annotations

from sidecar.membership.pool import EJECTED, SERVING, WARMING, BackendPool, RoutingTable
from sidecar.membership.sources import Member

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def members(urls: list[str]) -> list[Member]:
    return [Member(url, 1) for url in urls]


def test_every_pod_serving_builds_one_ring_for_routing_and_target() -> None:
    pool = BackendPool(warm_before_serve=False)
    pool.set_members(members(URLS))
    for url in URLS:
        pool.set_health(url, True)
    ring = pool.table.ring
    assert ring is not None and list(ring.members) == URLS
    assert pool.target_ring() is ring


def test_a_warming_pod_is_on_the_target_ring_only() -> None:
    warming: list[str] = []
    pool = BackendPool(needs_warming=lambda: True, on_warm_needed=warming.append)
    pool.set_members(members(URLS))
    for url in URLS[:3]:
        pool.set_health(url, True)
        pool.mark_warm(url)
    pool.set_health(URLS[3], True)
    assert warming[-1] == URLS[3]
    assert pool.backends[URLS[3]].state == WARMING
    ring, target = pool.table.ring, pool.target_ring()
    assert ring is not None and target is not None and target is not ring
    assert list(ring.members) == URLS[:3] and list(target.members) == URLS
    pool.mark_warm(URLS[3])
    assert pool.backends[URLS[3]].state == SERVING
    assert pool.target_ring() is pool.table.ring


def test_with_no_pod_serving_requests_go_to_the_warming_ones() -> None:
    """A cold start: a cold answer beats no answer; the target ring is the same ring."""
    pool = BackendPool()
    pool.set_members(members(URLS))
    pool.set_health(URLS[0], False)
    ring = pool.table.ring
    assert pool.backends[URLS[0]].state == EJECTED
    assert ring is not None and list(ring.members) == URLS[1:]
    assert pool.target_ring() is ring
    for url in URLS:
        pool.set_health(url, False)
    assert pool.table.ring is None and pool.target_ring() is None


def test_watchers_hear_every_new_table_in_order() -> None:
    heard: list[tuple[str, int]] = []

    def first(table: RoutingTable) -> None:
        heard.append(("first", table.generation))

    pool = BackendPool(warm_before_serve=False, on_change=first)
    pool.watch(lambda table: heard.append(("second", table.generation)))
    pool.set_members(members(URLS[:2]))
    pool.set_health(URLS[0], True)
    assert heard == [("first", 1), ("second", 1), ("first", 2), ("second", 2)]
    assert pool.generation == pool.table.generation == 2


def test_in_flight_counts_are_mirrored_into_the_tables_loads() -> None:
    pool = BackendPool(warm_before_serve=False)
    pool.set_members(members(URLS[:2]))
    for url in URLS[:2]:
        pool.set_health(url, True)
    pool.acquire(URLS[1])
    pool.acquire(URLS[1])
    pool.release(URLS[0])  # never below zero
    assert list(pool.table.loads) == [0, 2]
    pool.set_health(URLS[0], False)  # a new table keeps the counts
    assert list(pool.table.loads) == [2]
    pool.release(URLS[1])
    assert pool.backends[URLS[1]].in_flight == 1 and list(pool.table.loads) == [1]
