"""The pods' load reports: the ORCA header and /metrics parsers (hostile input included), the
load rule and its staleness fallback, the agreed KV size, and the poller's bounded sampling
against real aiohttp pods on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession, web
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator

from prefix_sidecar.membership.load_signals import (
    MAX_HEADER_CHARS,
    LoadRule,
    LoadSignals,
    MetricsError,
    MetricsPoller,
    PodReport,
    PodState,
    fetch_metrics,
    parse_load_header,
    parse_metrics,
)
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.membership.sources import Member

VLLM_TEXT = "TEXT named_metrics.kv_cache_usage_perc=0.42, named_metrics.num_requests_waiting=3.0"
VLLM_JSON = 'JSON {"named_metrics": {"kv_cache_usage_perc": 0.42, "num_requests_waiting": 3.0}}'


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- the header -------------------------------------------------------------------------------


def test_vllm_text_and_json_headers_parse_alike() -> None:
    expected = PodReport(waiting=3.0, kv_usage=0.42)
    assert parse_load_header(VLLM_TEXT) == expected
    assert parse_load_header(VLLM_JSON) == expected
    assert parse_load_header("text named_metrics.num_requests_waiting=0.0") == PodReport(
        waiting=0.0
    )


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "BIN AAAA",
        "TEXT",
        "TEXT cpu_utilization=0.5",  # ORCA fields we do not use
        "TEXT named_metrics.num_requests_waiting=nan",
        "TEXT named_metrics.num_requests_waiting=inf",
        "TEXT named_metrics.num_requests_waiting=-1",
        "TEXT named_metrics.num_requests_waiting=1e300",
        "TEXT named_metrics.kv_cache_usage_perc=1.5",
        "TEXT named_metrics.num_requests_waiting=3=4",
        "TEXT named_metrics.num_requests_waiting",
        "JSON {",
        "JSON []",
        'JSON {"named_metrics": [1, 2]}',
        'JSON {"named_metrics": {"num_requests_waiting": true}}',
        'JSON {"named_metrics": {"num_requests_waiting": "3"}}',
        'JSON {"named_metrics": {"num_requests_waiting": ' + "9" * 500 + "}}",
        "JSON " + "[" * 5000,  # deep nesting: refused, not a RecursionError
        "TEXT named_metrics.num_requests_waiting=1" + "," * MAX_HEADER_CHARS,  # too long
    ],
)
def test_hostile_or_useless_headers_say_nothing(value: str | None) -> None:
    assert parse_load_header(value) is None


def test_a_bad_value_drops_only_itself() -> None:
    header = "TEXT named_metrics.kv_cache_usage_perc=oops, named_metrics.num_requests_waiting=2"
    assert parse_load_header(header) == PodReport(waiting=2.0)


def test_header_parsing_is_bounded_in_items_and_time() -> None:
    # Many items within the size limit: only the first MAX_HEADER_ITEMS are looked at.
    items = ", ".join(["named_metrics.x=1"] * 40 + ["named_metrics.num_requests_waiting=5"])
    assert len(items) < MAX_HEADER_CHARS
    assert parse_load_header("TEXT " + items) is None
    started = time.perf_counter()
    for _ in range(1000):
        parse_load_header("TEXT " + "a" * (MAX_HEADER_CHARS - 5))
    assert time.perf_counter() - started < 1.0  # linear: ~us each


# --- /metrics ---------------------------------------------------------------------------------

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 5.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="25000",x="None"} 1.0
vllm:cache_config_info{block_size="32",num_gpu_blocks="10000"} 1.0
"""


def test_metrics_page_adds_engines_and_takes_the_smallest_kv() -> None:
    report = parse_metrics(VLLM_PAGE)
    assert report == PodReport(running=7.0, waiting=1.0, kv_usage=0.5, kv_tokens=320_000)


@pytest.mark.parametrize(
    "page",
    [
        "",
        "vllm:num_requests_running{",
        'vllm:num_requests_running{model_name="m"}',
        "vllm:num_requests_running NaN",
        "vllm:num_requests_waiting -3",
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0',
        'vllm:cache_config_info{block_size="0",num_gpu_blocks="10"} 1.0',
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="' + "9" * 30 + '"} 1.0',
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="-5"} 1.0',
        "not_vllm:num_requests_running 3",
    ],
)
def test_bad_metrics_lines_are_ignored(page: str) -> None:
    assert parse_metrics(page) == PodReport()


def test_metrics_parsing_stays_linear_on_hostile_labels() -> None:
    # Unclosed quotes and backslashes: the label pattern has no nested quantifier to explode.
    line = 'vllm:cache_config_info{block_size="16' + "\\" * 4000 + 'a="' * 1000 + "} 1\n"
    started = time.perf_counter()
    parse_metrics(line * 20)
    assert time.perf_counter() - started < 0.5


async def test_emulator_page_parses() -> None:
    config = EmulatorConfig(kv_tokens=160_000)
    async with run_emulator(config) as url, ClientSession() as session:
        report = await fetch_metrics(session, url, timeout_s=2.0)
    assert report == PodReport(running=0.0, waiting=0.0, kv_usage=0.0, kv_tokens=160_000)


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
    pool = BackendPool()
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


# --- the poller -------------------------------------------------------------------------------


class Pods:
    """N real aiohttp pods answering /metrics, counting the polls each gets."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.polls: dict[str, int] = {}
        self.page = VLLM_PAGE
        self.delay_s = 0.0


async def redirect(request: web.Request) -> web.Response:
    raise web.HTTPFound("/metrics")


@pytest.fixture
async def pods() -> AsyncIterator[Pods]:
    state = Pods()
    runners = []
    for _ in range(20):

        async def handle(request: web.Request) -> web.Response:
            url = f"http://127.0.0.1:{request.url.port}"
            state.polls[url] = state.polls.get(url, 0) + 1
            if state.delay_s:
                await asyncio.sleep(state.delay_s)
            return web.Response(text=state.page)

        app = web.Application()
        app.router.add_get("/metrics", handle)
        app.router.add_get("/redirect/metrics", redirect)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        state.urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    yield state
    for runner in runners:
        await runner.cleanup()


async def test_poller_asks_at_most_sample_pods_per_round(pods: Pods) -> None:
    loads: dict[str, int | None] = {}
    signals = LoadSignals(loads.__setitem__, LoadRule(max_age_s=2.0), over_cap=lambda u: 50)
    signals.set_members(pods.urls)
    async with ClientSession() as session:
        poller = MetricsPoller(
            signals, session, interval_s=0.01, sample=3, timeout_s=1.0, rng=random.Random(1)
        )
        for round_ in range(1, 6):
            await poller.poll_once()
            assert sum(pods.polls.values()) == 3 * round_
        assert max(pods.polls.values()) == 1  # the ones not heard from go first
        assert len(loads) == 15 and set(loads.values()) == {50}  # 1 waiting: saturated
        # Everyone heard from within refresh_after_s: nothing to ask.
        for _ in range(2):
            await poller.poll_once()
        assert sum(pods.polls.values()) == 20


async def test_poller_prefers_pods_this_sidecar_talks_to(pods: Pods) -> None:
    signals = LoadSignals(lambda url, load: None)
    signals.set_members(pods.urls)
    for url in pods.urls[5:7]:
        signals.note_sent(url)
    async with ClientSession() as session:
        poller = MetricsPoller(signals, session, sample=2, rng=random.Random(2))
        assert sorted(poller.choose()) == sorted(pods.urls[5:7])


async def test_fetch_is_bounded_in_bytes_and_time_and_follows_no_redirect(pods: Pods) -> None:
    url = pods.urls[0]
    async with ClientSession() as session:
        pods.page = "x" * 10_000
        with pytest.raises(MetricsError, match="more than 4096 bytes"):
            await fetch_metrics(session, url, timeout_s=1.0, max_bytes=4096)
        pods.page = VLLM_PAGE
        with pytest.raises(MetricsError, match="HTTP 302"):
            await fetch_metrics(session, url, timeout_s=1.0, path="/redirect/metrics")
        with pytest.raises(MetricsError, match="HTTP 404"):
            await fetch_metrics(session, url, timeout_s=1.0, path="/nothing")
        pods.delay_s = 1.0
        started = time.perf_counter()
        with pytest.raises(MetricsError, match="TimeoutError"):
            await fetch_metrics(session, url, timeout_s=0.1)
        assert time.perf_counter() - started < 0.5


async def test_a_failing_pod_is_not_asked_again_at_once(pods: Pods) -> None:
    signals = LoadSignals(lambda url, load: None, LoadRule(max_age_s=10.0))
    signals.set_members(["http://127.0.0.1:1"])  # nothing listens on port 1
    async with ClientSession() as session:
        poller = MetricsPoller(signals, session, sample=5, timeout_s=0.5)
        await poller.poll_once()
        assert poller.failures == 1
        assert poller.choose() == []  # asked: waits for refresh_after_s


@contextlib.asynccontextmanager
async def _busy_pod(rule: str) -> AsyncIterator[BackendPool]:
    """A real emulated pod running 1 and queueing 2 of another caller's requests, read by
    one real poll into a pool through `rule` ("saturation": reported over a cap of 77, or
    "fleet": the fleet view); the pool is yielded while the requests still run."""
    config = EmulatorConfig(model="m", max_running=1, decode_tps=20.0, time_scale=10.0)
    pool = BackendPool()
    async with run_emulator(config) as url, ClientSession() as session:
        pool.set_members([Member(url)])
        pool.set_health(url, True)
        if rule == "saturation":
            signals = LoadSignals(pool.report_load, over_cap=lambda u: 77)
        else:
            signals = LoadSignals(lambda u, n: None, on_reading=pool.report_reading)
        signals.set_members([url, "http://127.0.0.1:9"])  # another pod, not known saturated
        body = {"prompt": "same", "max_tokens": 11}
        tasks = [
            asyncio.create_task(session.post(url + "/v1/completions", json=body)) for _ in range(3)
        ]
        await asyncio.sleep(0.02)
        await MetricsPoller(signals, session, sample=2, timeout_s=0.5).poll_once()
        try:
            yield pool
        finally:
            for response in await asyncio.gather(*tasks):
                response.release()


async def test_pod_reports_reach_the_pick_through_the_emulator() -> None:
    """A real emulated pod, a real poll, the pool's loads: end to end."""
    async with _busy_pod("saturation") as pool:
        assert pool.table.loads[0] == 77  # 1 running, 2 waiting: saturated, over its cap


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
    async with _busy_pod("fleet") as pool:
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
