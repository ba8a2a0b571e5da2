"""The pod signals wired into a running Sidecar against emulated pods on 127.0.0.1: loads
reach the pool from the pods' own gauges, the KV budget follows the pods' cache config,
prefixes are counted by the pod's tokenizer, and `load_signals: false` turns the readings off."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from prefix_sidecar.membership.load_signals import poller, rules
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator
from prefix_sidecar_tools.emulator.tokenizer import count_tokens

from .conftest import sidecar_config, wait_for

FAST = EmulatorConfig(time_scale=1000.0)
# A pod that runs one request at a time, 100 tokens in 0.5 s real: easy to keep busy.
ONE_AT_A_TIME = dataclasses.replace(FAST, max_running=1, decode_tps=20.0, time_scale=10.0)


@pytest.fixture
def fast_readings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecar reads every pod every ~0.05 s and forgets a reading after 0.5 s (the
    constants are read when a Sidecar is built)."""
    monkeypatch.setattr(poller, "POLL_INTERVAL_S", 0.05)
    monkeypatch.setattr(poller, "POLL_SAMPLE", 2)
    monkeypatch.setattr(rules, "MAX_AGE_S", 0.5)


@contextlib.asynccontextmanager
async def _someone_elses_requests(pod: str, count: int = 3) -> AsyncIterator[None]:
    """`count` completions on `pod` from another caller, held while the block runs (0.5 s
    real each on a ONE_AT_A_TIME pod), then read to their end."""
    async with aiohttp.ClientSession() as session:
        body = {"prompt": "x", "max_tokens": 100}
        held = [
            asyncio.create_task(session.post(pod + "/v1/completions", json=body))
            for _ in range(count)
        ]
        try:
            yield
        finally:
            for response in await asyncio.gather(*held):
                response.release()


async def test_sidecar_reports_pod_load_kv_budget_and_prefix_tokens(
    tmp_path: Path, fast_readings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rules, "REPORT_SATURATION", True)
    big = dataclasses.replace(FAST, kv_tokens=320_000)
    small = dataclasses.replace(ONE_AT_A_TIME, kv_tokens=160_000)
    text = "compliance rules. " * 500
    async with run_emulator(big) as a, run_emulator(small) as b:
        # The saturation report is in requests: the rule is written for that unit.
        config = sidecar_config(tmp_path, [a, b], load_unit="requests")
        async with Sidecar(config) as sidecar:
            sidecar.pools.default.store.register("rules", text)
            entry = sidecar.pools.default.store.by_name("rules")
            await wait_for(lambda: entry.tokens > 0, what="the prefix's token count")
            assert entry.tokens == count_tokens(text.encode())
            # The smallest pod's KV x 0.5 is the budget: the router places with it.
            await wait_for(
                lambda: sidecar.pools.default.router.placer.budget_tokens == 80_000,
                what="the KV budget",
            )
            assert (
                sidecar.pools.default.signals is not None
                and sidecar.pools.default.signals.kv_tokens == 160_000
            )
            # The metric shows the budget in use, not the (unset) configured one.
            scraped = sidecar.metrics.render().decode()
            assert '\nprefix_sidecar_home_kv_budget_tokens{pool="default"} 80000.0\n' in scraped
            # Load the small pod behind the sidecar's back: its own gauges reach the pool.
            async with _someone_elses_requests(b):
                # 1 running, 2 waiting: saturated, reported at own (0) + its cap (the floor
                # 8: nothing else is in flight), so the next pick spills past it.
                await wait_for(
                    lambda: sidecar.pools.default.pool.backends[b].reported_load == 8,
                    what="b reported over its cap",
                )
                table = sidecar.pools.default.pool.table
                assert table.loads[table.index[b]] == 8
            await wait_for(
                lambda: sidecar.pools.default.pool.backends[b].reported_load is None,
                what="b idle again",
            )


async def test_signals_off_reads_no_load(tmp_path: Path) -> None:
    """`load_signals: false`: no header asked, no polls, no readings; a prefix is still
    counted by the pod's tokenizer (the placement's size, not a load signal)."""
    async with run_emulator(FAST) as a:
        config = sidecar_config(tmp_path, [a], load_signals=False)
        async with Sidecar(config) as sidecar:
            sidecar.pools.default.store.register("rules", "some rules " * 100)
            entry = sidecar.pools.default.store.by_name("rules")
            await wait_for(lambda: entry.tokens > 0, what="the prefix's token count")
            await asyncio.sleep(0.3)
            assert sidecar.pools.default.signals is None and sidecar.pools.default.poller is None
            assert sidecar.pools.default.pool.backends[a].reported_load is None


def test_the_over_cap_report_is_the_smallest_load_over_the_cap(tmp_path: Path) -> None:
    """Whatever the loads, the report v puts the pod over its cap once it joins the total,
    and v - 1 would not (unless the floor decides): the others' caps grow least."""
    import random

    from prefix_sidecar.membership.sources import Member

    pods = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]
    sidecar = Sidecar(sidecar_config(tmp_path, pods, load_unit="requests"))
    pool = sidecar.pools.default.pool
    pool.set_members([Member(url) for url in pods])
    for url in pods:
        pool.set_health(url, True)
    rng = random.Random(7)
    for _ in range(200):
        url = rng.choice(pods)
        for _ in range(rng.randrange(0, 40)):
            pool.acquire(rng.choice(pods))
        v = sidecar.pools.default._over_cap_load(url)
        assert v is not None
        table = pool.table
        rest = table.total - table.loads[table.index[url]]

        def cap(load: int, rest: int = rest) -> float:
            return max(8, math.ceil(1.25 * (rest + load + 1) / 5))

        assert v + 1 > cap(v), (v, rest)
        assert v == 8 or v <= cap(v - 1), (v, rest)  # one less would still fit


async def test_the_fleet_view_sees_another_callers_load_and_exports_it(
    tmp_path: Path, fast_readings: None
) -> None:
    """The fleet view (rules.FLEET_VIEW, the default): a pod busy with someone else's
    requests reaches the pool and the metrics at its running + waiting; with none of our own
    read yet, own counts pick."""
    async with run_emulator(FAST) as a, run_emulator(ONE_AT_A_TIME) as b:
        config = sidecar_config(tmp_path, [a, b])
        async with Sidecar(config) as sidecar:
            async with _someone_elses_requests(b):
                await wait_for(
                    lambda: sidecar.pools.default.pool.backends[b].reported_load == 3,
                    what="b's 1 running + 2 waiting in the pool",
                )
                scraped = sidecar.metrics.render().decode()
                assert f'prefix_sidecar_backend_reported_load{{backend="{b}"}} 3.0' in scraped
                # None of our own requests were read yet: K is unknown, own counts decide.
                assert f'prefix_sidecar_backend_load{{backend="{b}"}} 0.0' in scraped
                assert '\nprefix_sidecar_fleet_scale{pool="default"} 1.0\n' in scraped
            await wait_for(
                lambda: sidecar.pools.default.pool.backends[b].reported_load == 0,
                what="b idle again",
            )
