"""The backend pool: which pods are on the routing ring and the target ring, one ring when
they are the same pods, and the watchers that hear of every new table."""

from __future__ import annotations

import math
import random

import pytest

from prefix_sidecar.membership.pool import (
    EJECTED,
    MAX_COMPUTED,
    MAX_FLEET_SCALE,
    MAX_REPORTED_LOAD,
    MIN_SCALE_SAMPLE,
    SERVING,
    WARMING,
    BackendPool,
    RoutingTable,
)
from prefix_sidecar.membership.sources import Member
from prefix_sidecar.routing.cost import DECODE_TOKENS, Prefill

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def members(urls: list[str]) -> list[Member]:
    return [Member(url, 1) for url in urls]


def test_every_pod_serving_builds_one_ring_for_routing_and_target() -> None:
    pool = BackendPool(load_unit="requests", warm_before_serve=False)
    pool.set_members(members(URLS))
    for url in URLS:
        pool.set_health(url, True)
    ring = pool.table.ring
    assert ring is not None and list(ring.members) == URLS
    assert pool.target_ring() is ring


def test_a_warming_pod_is_on_the_target_ring_only() -> None:
    warming: list[str] = []
    pool = BackendPool(
        load_unit="requests", needs_warming=lambda: True, on_warm_needed=warming.append
    )
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
    pool = BackendPool(load_unit="requests")
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

    pool = BackendPool(load_unit="requests", warm_before_serve=False)
    pool.watch(first)
    pool.watch(lambda table: heard.append(("second", table.generation)))
    pool.set_members(members(URLS[:2]))
    pool.set_health(URLS[0], True)
    assert heard == [("first", 1), ("second", 1), ("first", 2), ("second", 2)]
    assert pool.table.generation == 2


def test_in_flight_counts_are_mirrored_into_the_tables_loads() -> None:
    pool = BackendPool(load_unit="requests", warm_before_serve=False)
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


def serving_pool(urls: list[str]) -> BackendPool:
    pool = BackendPool(load_unit="requests", warm_before_serve=False)
    pool.set_members(members(urls))
    for url in urls:
        pool.set_health(url, True)
    return pool


def test_the_tables_total_is_the_sum_of_its_loads_after_every_change() -> None:
    pool = serving_pool(URLS[:3])
    steps = [
        lambda: pool.acquire(URLS[0]),
        lambda: pool.acquire(URLS[0]),
        lambda: pool.report_load(URLS[1], 5),
        lambda: pool.acquire(URLS[1]),  # 1 own < 5 reported: no change
        lambda: pool.report_load(URLS[0], 1),  # 1 reported < 2 own: own wins
        lambda: pool.release(URLS[2]),  # never below zero
        lambda: pool.report_load(URLS[1], None),  # stale: back to own in-flight
        lambda: pool.set_health(URLS[2], False),  # a new table starts from the pods' loads
        lambda: pool.release(URLS[0]),
        lambda: pool.report_load(URLS[2], 7),  # not on the ring: the table is untouched
        lambda: pool.set_health(URLS[2], True),
    ]
    for step in steps:
        step()
        table = pool.table
        assert table.total == sum(table.loads)
        assert list(table.loads) == [pool.backends[url].load for url in table.members]
    assert list(pool.table.loads) == [1, 1, 7]


def test_the_effective_load_is_the_larger_of_own_in_flight_and_the_report() -> None:
    pool = serving_pool(URLS[:2])
    pool.acquire(URLS[0])
    pool.acquire(URLS[0])
    pool.report_load(URLS[0], 6)
    assert list(pool.table.loads) == [6, 0] and pool.table.total == 6
    pool.report_load(URLS[0], 0)
    assert list(pool.table.loads) == [2, 0] and pool.table.total == 2
    pool.report_load(URLS[0], None)
    assert pool.backends[URLS[0]].reported_load is None
    assert list(pool.table.loads) == [2, 0] and pool.table.total == 2


def test_a_reported_load_is_checked_and_clamped() -> None:
    pool = serving_pool(URLS[:1])
    with pytest.raises(ValueError, match=">= 0"):
        pool.report_load(URLS[0], -1)
    with pytest.raises(TypeError, match="int or None"):
        pool.report_load(URLS[0], 2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int or None"):
        pool.report_load(URLS[0], True)
    pool.report_load(URLS[0], 1 << 62)  # a hostile pod cannot overflow the total
    assert pool.table.total == MAX_REPORTED_LOAD
    pool.report_load("http://10.9.9.9:8000", 3)  # not a member: ignored
    assert pool.table.total == MAX_REPORTED_LOAD


def test_the_pool_builds_the_chosen_table_for_routing_and_target() -> None:
    """hash_table "maglev": the routing and target tables are Maglev tables over the same pods
    the ring would hold; warming and ejection work the same; the loads keep their total."""
    pool = BackendPool(
        needs_warming=lambda: True,
        on_warm_needed=lambda url: None,
        hash_table="maglev",
        load_unit="requests",
    )
    pool.set_members(members(URLS))
    for url in URLS:
        pool.set_health(url, True)
        pool.mark_warm(url)
    table = pool.table.ring
    assert type(table).__name__ == "Maglev" and pool.target_ring() is table
    assert table is not None and list(table.members) == URLS
    pool.set_health(URLS[3], False)
    pool.set_health(URLS[3], True)  # back, warming: on the target table only
    routing, target = pool.table.ring, pool.target_ring()
    assert routing is not None and target is not None
    assert list(routing.members) == URLS[:3] and list(target.members) == URLS
    assert type(routing) is type(target)
    pool.acquire(URLS[0])
    pool.report_load(URLS[1], 4)
    assert pool.table.total == sum(pool.table.loads) == 5


@pytest.mark.parametrize("report", ["report_load", "report_reading"])
def test_the_total_invariant_holds_through_random_changes(report: str) -> None:
    """pick trusts table.total == sum(table.loads) (routing contract section 4): keep it
    through random acquires, releases, reports (plain, or the fleet view's readings) and
    health changes."""
    chance = random.Random(15)
    pool = serving_pool(URLS)
    report_load = getattr(pool, report)
    for _ in range(1500):
        url = chance.choice(URLS)
        action = chance.random()
        if action < 0.4:
            pool.acquire(url)
        elif action < 0.75:
            pool.release(url)
        elif action < 0.95:
            report_load(url, chance.choice([None, 0, 1, 3, 9, 40, 200]))
        else:
            pool.set_health(url, not pool.backends[url].healthy)
        table = pool.table
        assert table.total == sum(table.loads)
        assert list(table.loads) == [pool.backends[u].load for u in table.members]


# --- the fleet view (docs/load-signals.md, rule 3) ---------------------------------------------


def test_the_fleet_view_moves_a_reading_by_our_sends_times_the_k_estimate() -> None:
    """Each pod read at 8 of ours and 32 in all: K = 4. A choice of ours since counts as K;
    an unread pod counts own x K; a stale reading takes its pod back to own x K."""
    pool = serving_pool(URLS[:3])
    for url in URLS[:2]:
        for _ in range(8):
            pool.acquire(url)
        pool.report_reading(url, 32)
    assert pool.fleet_scale == 4.0
    pool.acquire(URLS[2])
    assert list(pool.table.loads) == [32, 32, 4]
    pool.acquire(URLS[0])  # one more of ours: about K more of everyone's
    pool.release(URLS[1])  # one of ours ended: about K fewer
    assert list(pool.table.loads) == [36, 28, 4]
    pool.report_reading(URLS[0], 36)  # a new reading re-anchors at our 9
    assert pool.table.loads[0] == 36
    pool.report_reading(URLS[1], None)  # stale: own x K
    assert pool.table.loads[1] == math.ceil(7 * pool.fleet_scale)
    assert pool.table.total == sum(pool.table.loads)


def test_the_fleet_view_counts_a_key_s_only_home_once_and_choices_k_fold() -> None:
    """K = 4. A request its pod took as the key's only home (chosen=False) moves the
    reading by one: the other sidecars' such requests do not follow ours. A choice (among
    pods by load, a spill, a failover) moves it by K: they choose on the same reading."""
    pool = serving_pool(URLS[:2])
    for url in URLS[:2]:
        for _ in range(8):
            pool.acquire(url, chosen=False)
        pool.report_reading(url, 32)
    assert pool.fleet_scale == 4.0
    pool.acquire(URLS[0], chosen=False)
    pool.acquire(URLS[0], chosen=False)
    pool.acquire(URLS[1])  # chosen
    assert list(pool.table.loads) == [34, 36]
    pool.release(URLS[0], chosen=False)
    pool.release(URLS[1])
    pool.release(URLS[1], chosen=False)
    assert list(pool.table.loads) == [33, 31]
    pool.acquire(URLS[0])  # a choice made before the next reading ...
    pool.report_reading(URLS[0], 37)  # ... is in it: the reading re-anchors both counts
    pool.acquire(URLS[0])
    pool.release(URLS[0], chosen=False)
    assert pool.fleet_scale == 4.0  # (37 + 32) / (10 + 8) = 3.83: within 10 %, kept
    assert pool.table.loads[0] == 37 + 0 + 1 * 3  # own unchanged, one more choice: K - 1
    assert pool.table.total == sum(pool.table.loads)
    for _ in range(20):
        pool.release(URLS[0])  # releases never take either count below zero
    assert pool.backends[URLS[0]].in_flight == 0 and pool.backends[URLS[0]].chosen == 0


def test_the_fleet_view_never_goes_below_own_and_one_sidecar_sees_its_own() -> None:
    pool = serving_pool(URLS[:2])
    for _ in range(5):
        pool.acquire(URLS[0])
    pool.report_reading(URLS[0], 5)  # alone: the pod counts exactly our requests
    assert pool.fleet_scale == 1.0 and pool.table.loads[0] == 5
    pool.report_reading(URLS[0], 0)  # a reading that lags our sends: own still counts
    assert pool.table.loads[0] == 5
    for _ in range(5):
        pool.release(URLS[0])
    assert pool.table.loads[0] == 0


def test_the_k_estimate_needs_enough_of_our_requests_and_is_bounded() -> None:
    pool = serving_pool(URLS[:3])
    for _ in range(MIN_SCALE_SAMPLE - 1):
        pool.acquire(URLS[0])
    pool.report_reading(URLS[0], 150)  # 15 requests of ours are too few: K stays 1
    assert pool.fleet_scale == 1.0
    pool.acquire(URLS[1])
    pool.report_reading(URLS[1], 1 << 40)  # hostile: clamped to MAX_REPORTED_LOAD
    assert pool.fleet_scale == MAX_FLEET_SCALE
    pool.report_reading(URLS[1], 10)  # over both read pods: (150 + 10) / (15 + 1)
    assert pool.fleet_scale == 10.0
    pool.report_reading(URLS[0], 0)  # fewer than ours: K is never below 1
    assert pool.fleet_scale == 1.0
    pool.report_reading(URLS[0], 310)
    assert pool.fleet_scale == 20.0
    pool.set_members(members(URLS[1:]))  # a pod that leaves leaves the estimate
    assert pool.fleet_scale == 1.0  # 1 of ours read: too few again
    pool.report_reading("http://10.9.9.9:8000", 3)  # not a member: ignored


def test_readings_wait_until_the_k_estimate_is_known() -> None:
    """Early in a run: pods read at everyone's 10 beside our 1 each, K unknown (fewer than
    MIN_SCALE_SAMPLE of ours on read pods): own counts decide, in one unit. Once 16 of ours
    were read, the readings count and an unread pod counts own x K."""
    assert MIN_SCALE_SAMPLE == 16
    pool = serving_pool(URLS[:3])
    for url in URLS[:3]:
        pool.acquire(url)
    for url in URLS[:3]:
        pool.report_reading(url, 10)
    assert list(pool.table.loads) == [1, 1, 1]
    pool.report_reading(URLS[2], None)
    for _ in range(14):
        pool.acquire(URLS[0])
    pool.report_reading(URLS[0], 150)  # 15 + 1 of ours read: K = (150 + 10) / 16 = 10
    assert pool.fleet_scale == 10.0
    assert list(pool.table.loads) == [150, 10, 10]  # the unread pod at own x K
    assert pool.table.total == sum(pool.table.loads)


def test_load_in_tokens_weighs_a_prefill_until_its_first_token() -> None:
    """load_unit tokens (routing/cost.py): a request weighs its uncached prefill until its
    first token, and DECODE_TOKENS while it runs; the table's total follows every change."""
    pool = BackendPool(warm_before_serve=False, load_unit="tokens")
    pool.set_members(members(URLS[:2]))
    for url in URLS[:2]:
        pool.set_health(url, True)
    pool.acquire(URLS[0], prefill=16_000)
    pool.acquire(URLS[1])
    assert list(pool.table.loads) == [16_000 + DECODE_TOKENS, DECODE_TOKENS]
    pool.prefilled(URLS[0], 16_000)
    assert pool.table.loads[0] == DECODE_TOKENS
    pool.release(URLS[0])
    pool.release(URLS[1])
    assert list(pool.table.loads) == [0, 0] and pool.table.total == 0
    # Released before its first token: its prefill goes with it.
    pool.acquire(URLS[0], prefill=500)
    pool.release(URLS[0], prefill=500)
    assert pool.table.loads[0] == 0
    # A pod reading 5 running and waiting while 2 of ours weigh 300 each: the 3 others
    # weigh our mean.
    pool.acquire(URLS[1], prefill=172)
    pool.acquire(URLS[1], prefill=172)
    pool.report_load(URLS[1], 5)
    assert pool.table.loads[1] == 2 * 300 + 3 * 300
    assert pool.table.total == sum(pool.table.loads)
    with pytest.raises(ValueError, match="unknown load unit"):
        BackendPool(load_unit="bytes")


def test_a_prefix_weighs_on_a_pod_not_known_to_hold_it_until_it_computed_it() -> None:
    """Prefill.of(decision): the prefix's own tokens count on a pod that is none of its
    homes, was not prewarmed with it and has not computed it for a request yet."""
    pool = BackendPool(warm_before_serve=False, load_unit="tokens")
    pool.set_members(members(URLS[:3]))
    home, prewarmed, other = URLS[:3]
    pool.note_warm_prefix(prewarmed, "p")
    prefill = Prefill(tokens=50, cold=60_000, prefix_id="p", homes=(home,))
    assert [pool.prefill_on(prefill, url) for url in URLS[:3]] == [50, 50, 60_050]
    pool.prefilled(other, 60_050, "p")  # its first token: it holds the prefix now
    assert pool.prefill_on(prefill, other) == 50
    assert pool.prefill_on(Prefill(tokens=7), other) == 7
    for n in range(MAX_COMPUTED + 5):
        pool.prefilled(other, 0, f"q{n}")
    assert (
        len(pool.backends[other].computed) == MAX_COMPUTED
        and "p" not in pool.backends[other].computed
    )
