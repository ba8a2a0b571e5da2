"""Asking the pods (membership/load_signals/poller.py): bounded sampling, bounded fetches,
no redirects, failing pods left alone, against real aiohttp pods and the emulator on
127.0.0.1."""

from __future__ import annotations

import random
import time

import pytest

from prefix_sidecar.membership.load_signals import (
    LoadRule,
    LoadSignals,
    MetricsError,
    MetricsPoller,
    fetch_metrics,
)
from prefix_sidecar.upstream.client import UpstreamClient

from .conftest import VLLM_PAGE, Pods, busy_pod

# --- the poller -------------------------------------------------------------------------------


async def test_poller_asks_at_most_sample_pods_per_round(pods: Pods) -> None:
    loads: dict[str, int | None] = {}
    signals = LoadSignals(loads.__setitem__, LoadRule(max_age_s=2.0), over_cap=lambda u: 50)
    signals.set_members(pods.urls)
    async with UpstreamClient() as client:
        poller = MetricsPoller(
            signals, client, interval_s=0.01, sample=3, timeout_s=1.0, rng=random.Random(1)
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
    async with UpstreamClient() as client:
        poller = MetricsPoller(signals, client, sample=2, rng=random.Random(2))
        assert sorted(poller.choose()) == sorted(pods.urls[5:7])


async def test_fetch_is_bounded_in_bytes_and_time_and_follows_no_redirect(pods: Pods) -> None:
    url = pods.urls[0]
    async with UpstreamClient() as client:
        pods.page = "x" * 10_000
        with pytest.raises(MetricsError, match="more than 4096 bytes"):
            await fetch_metrics(client, url, timeout_s=1.0, max_bytes=4096)
        pods.page = VLLM_PAGE
        with pytest.raises(MetricsError, match="HTTP 302"):
            await fetch_metrics(client, url, timeout_s=1.0, path="/redirect/metrics")
        with pytest.raises(MetricsError, match="HTTP 404"):
            await fetch_metrics(client, url, timeout_s=1.0, path="/nothing")
        pods.delay_s = 1.0
        started = time.perf_counter()
        with pytest.raises(MetricsError, match=r"timed out after 0\.1s"):
            await fetch_metrics(client, url, timeout_s=0.1)
        assert time.perf_counter() - started < 0.5


async def test_a_failing_pod_is_not_asked_again_at_once(pods: Pods) -> None:
    signals = LoadSignals(lambda url, load: None, LoadRule(max_age_s=10.0))
    signals.set_members(["http://127.0.0.1:1"])  # nothing listens on port 1
    async with UpstreamClient() as client:
        poller = MetricsPoller(signals, client, sample=5, timeout_s=0.5)
        await poller.poll_once()
        assert poller.failures == 1
        assert poller.choose() == []  # asked: waits for refresh_after_s


async def test_pod_reports_reach_the_pick_through_the_emulator() -> None:
    """A real emulated pod, a real poll, the pool's loads: end to end."""
    async with busy_pod("saturation") as pool:
        assert pool.table.loads[0] == 77  # 1 running, 2 waiting: saturated, over its cap
