"""What a reading means for a pod's load (membership/load_signals/rules.py): the saturation
rule and its staleness fallback, the agreed KV size, and the fleet view (rule 3)."""

from __future__ import annotations

import math

from prefix_sidecar.membership.load_signals import (
    LoadRule,
    LoadSignals,
    PodReport,
    PodState,
)
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.membership.sources import Member

from .conftest import VLLM_TEXT, Clock, busy_pod

# --- the rule and its staleness ----------------------------------------------------------


def test_saturated_means_a_fresh_queue_or_full_kv() -> None:
    rule = LoadRule(max_age_s=2.0, kv_threshold=0.9)
    pod = PodState()
    assert rule.saturated(pod, 0.0) is None  # never heard: unknown
    pod.take(PodReport(running=5.0), now=9.0)
    assert rule.saturated(pod, 9.0) is None  # running alone says nothing about saturation
    pod.take(PodReport(running=5.0, waiting=0.0, kv_usage=0.5), now=10.0)
    assert rule.saturated(pod, 10.0) is False
    pod.take(PodReport(waiting=2.0), now=11.0)
    assert rule.saturated(pod, 11.0) is True  # queueing
    pod.take(PodReport(waiting=0.0, kv_usage=0.9), now=11.5)
    assert rule.saturated(pod, 11.5) is True  # KV full
    assert rule.saturated(pod, 12.01) is True  # the KV reading (11.5) is still fresh
    pod.take(PodReport(kv_usage=0.2), now=13.0)
    assert rule.saturated(pod, 13.0) is False
    assert rule.saturated(pod, 15.01) is None  # everything aged out: back to own in-flight


def _pool(*urls: str) -> BackendPool:
    pool = BackendPool(load_unit="requests")
    pool.set_members([Member(url) for url in urls])
    for url in urls:
        pool.set_health(url, True)
    return pool


def test_a_saturated_pod_is_reported_over_its_cap_until_stale() -> None:
    clock = Clock()
    pool = _pool("http://a:1", "http://b:1")
    over = {"http://a:1": 20, "http://b:1": 30}
    signals = LoadSignals(pool.report_load, LoadRule(max_age_s=2.0), over_cap=over.get, clock=clock)
    signals.set_members(pool.backends)
    pool.acquire("http://a:1")
    index = pool.table.index
    signals.observe("http://a:1", PodReport(running=6.0, waiting=0.0, kv_usage=0.1))
    signals.observe_header("http://b:1", VLLM_TEXT)  # 3 waiting: saturated
    assert pool.backends["http://a:1"].reported_load is None  # not saturated: own decides
    assert pool.table.loads[index["http://a:1"]] == 1
    assert pool.table.loads[index["http://b:1"]] == 30
    clock.now += 2.5
    signals.expire()
    assert pool.table.loads[index["http://b:1"]] == 0  # stale: own in-flight again
    assert signals.headers_seen == 1
    signals.observe_header("http://b:1", "TEXT garbage")
    assert signals.headers_refused == 1
    signals.observe_header("http://b:1", "TEXT named_metrics.num_requests_waiting=0.0")
    assert pool.backends["http://b:1"].reported_load is None


def test_the_over_cap_load_really_makes_the_pick_spill() -> None:
    """With a report at own + cap, bounded load skips the saturated home for the next pod."""
    pool = _pool(*(f"http://p{i}:1" for i in range(4)))
    table = pool.table
    assert table.ring is not None
    key = 12345
    home = table.ring.preference(key, 1)[0]

    def over_cap(url: str) -> int:
        t = pool.table
        cap = math.ceil(1.25 * (t.total + 1) / 4)
        return pool.backends[url].in_flight + max(8, cap)

    signals = LoadSignals(pool.report_load, over_cap=over_cap)
    signals.set_members(pool.backends)
    signals.observe(home, PodReport(waiting=1.0))
    table = pool.table
    assert table.ring is not None
    member, branch = table.ring.pick(key, table.loads, 1, 1.25, 8)
    assert member != home and branch == "spill"


def test_when_every_pod_is_saturated_none_is_reported() -> None:
    loads: dict[str, int | None] = {}
    signals = LoadSignals(loads.__setitem__, over_cap=lambda url: 40, clock=Clock())
    signals.set_members(["http://a:1", "http://b:1"])
    signals.observe("http://a:1", PodReport(waiting=2.0))
    assert loads == {"http://a:1": 40}
    signals.observe("http://b:1", PodReport(waiting=1.0))  # now all: own counts decide
    assert loads == {"http://a:1": None} and signals.all_saturated
    signals.observe("http://b:1", PodReport(waiting=0.0))  # b drained: a is skipped again
    assert loads == {"http://a:1": 40} and not signals.all_saturated


def test_sidecars_seeing_the_same_pod_state_report_the_same_loads() -> None:
    loads: list[dict[str, int | None]] = [{}, {}]
    pods = [f"http://p{i}:1" for i in range(5)]
    reports = [PodReport(running=float(i * 3), waiting=float(i % 2)) for i in range(5)]
    for seen in loads:
        signals = LoadSignals(seen.__setitem__, over_cap=lambda url: 99, clock=Clock())
        signals.set_members(reversed(pods))
        for url, report in zip(pods, reports, strict=True):
            signals.observe(url, report)
    assert loads[0] == loads[1] == {pods[1]: 99, pods[3]: 99}


def test_kv_agreement_is_the_smallest_known_size() -> None:
    seen: list[int | None] = []
    signals = LoadSignals(lambda url, load: None, on_kv=seen.append, clock=Clock())
    signals.set_members(["http://a:1", "http://b:1"])
    assert signals.kv_tokens is None and seen == []  # unknown: the config decides
    signals.observe("http://a:1", PodReport(kv_tokens=400_000))
    signals.observe("http://b:1", PodReport(kv_tokens=300_000))
    signals.observe("http://a:1", PodReport(kv_tokens=400_000))  # no change: no callback
    assert seen == [400_000, 300_000]
    signals.set_members(["http://a:1"])  # the small pod left
    assert seen[-1] == 400_000
    signals.set_members([])
    assert seen[-1] is None
    signals.observe("http://gone:1", PodReport(kv_tokens=1))  # not a member: ignored
    assert signals.kv_tokens is None


# --- the fleet view (rule 3) ------------------------------------------------------------------


def test_the_fleet_view_takes_running_plus_waiting_until_stale() -> None:
    clock = Clock()
    readings: list[tuple[str, int | None]] = []
    rule = LoadRule(max_age_s=2.0)
    signals = LoadSignals(
        lambda url, load: None, rule, on_reading=lambda u, n: readings.append((u, n)), clock=clock
    )
    signals.set_members(["http://a:1", "http://b:1"])
    signals.observe("http://a:1", PodReport(running=6.0, waiting=2.0, kv_usage=0.3))
    signals.observe_header("http://a:1", VLLM_TEXT)  # no running count: not a load
    assert readings == [("http://a:1", 8)]
    # A header keeps a pod "heard" but not read: the poller still asks it for /metrics.
    clock.now += 1.5
    assert sorted(signals.stale(1.0)) == ["http://a:1", "http://b:1"]
    signals.observe("http://a:1", PodReport(running=4.4))  # the header's 3 waiting is fresh
    assert readings[-1] == ("http://a:1", 7)
    clock.now += 2.5
    signals.expire()
    assert readings[-1] == ("http://a:1", None)
    signals.expire()  # once
    assert len(readings) == 3


async def test_the_fleet_view_reaches_the_pool_through_the_emulator() -> None:
    """One poll brings the pod's 1 running + 2 waiting into the pool; a sidecar with none of
    its own requests there cannot estimate K yet, so it still picks on its own count."""
    async with busy_pod("fleet") as pool:
        url = pool.table.members[0]
        assert pool.backends[url].reported_load == 3
        assert pool.table.loads[0] == 0


def test_the_fleet_view_uses_no_reading_while_every_pod_is_saturated() -> None:
    """All pods queueing: the readings all say "full" and are up to an interval old; each
    sidecar's own live counts decide until one pod drains, then the fresh readings again."""
    readings: dict[str, int | None] = {}
    signals = LoadSignals(lambda u, n: None, on_reading=readings.__setitem__, clock=Clock())
    signals.set_members(["http://a:1", "http://b:1"])
    signals.observe("http://a:1", PodReport(running=256.0, waiting=9.0))
    assert readings == {"http://a:1": 265}
    signals.observe("http://b:1", PodReport(running=256.0, waiting=4.0))  # now all
    assert readings == {"http://a:1": None} and signals.all_saturated
    signals.observe("http://a:1", PodReport(running=250.0, waiting=0.0))  # a drained
    assert readings == {"http://a:1": 250, "http://b:1": 260}


def test_the_fleet_view_keeps_its_readings_while_every_pod_s_kv_is_full() -> None:
    """A prefix cache budgeted to its pods' KV runs near full by design: KV use alone is not
    the whole fleet queueing, so the readings stay in use (the saturation report, rule 2,
    still counts KV)."""
    readings: dict[str, int | None] = {}
    signals = LoadSignals(lambda u, n: None, on_reading=readings.__setitem__, clock=Clock())
    signals.set_members(["http://a:1", "http://b:1"])
    signals.observe("http://a:1", PodReport(running=140.0, waiting=0.0, kv_usage=0.97))
    signals.observe("http://b:1", PodReport(running=120.0, waiting=0.0, kv_usage=0.99))
    assert readings == {"http://a:1": 140, "http://b:1": 120} and not signals.all_saturated
    assert signals.saturated("http://a:1") and signals.saturated("http://b:1")
    signals.observe("http://a:1", PodReport(running=140.0, waiting=2.0, kv_usage=0.97))
    assert readings == {"http://a:1": 142, "http://b:1": 120}  # b does not queue
    signals.observe("http://b:1", PodReport(running=120.0, waiting=1.0, kv_usage=0.99))
    assert readings == {"http://a:1": None, "http://b:1": None} and signals.all_saturated
