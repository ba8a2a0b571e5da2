"""Shared by the load-signal tests: a fake clock, vLLM's header and /metrics page, 20 real
aiohttp pods answering /metrics on 127.0.0.1, and an emulated pod kept busy by another
caller."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession, web

from prefix_sidecar.membership.load_signals import (
    LoadSignals,
    MetricsPoller,
)
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.membership.sources import Member
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator
from tests.fake_pod import start_site

VLLM_TEXT = "TEXT named_metrics.kv_cache_usage_perc=0.42, named_metrics.num_requests_waiting=3.0"
VLLM_JSON = 'JSON {"named_metrics": {"kv_cache_usage_perc": 0.42, "num_requests_waiting": 3.0}}'
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


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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
        runner, base_url = await start_site(app)
        runners.append(runner)
        state.urls.append(base_url)
    yield state
    for runner in runners:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def busy_pod(rule: str) -> AsyncIterator[BackendPool]:
    """A real emulated pod running 1 and queueing 2 of another caller's requests, read by
    one real poll into a pool through `rule` ("saturation": reported over a cap of 77, or
    "fleet": the fleet view); the pool is yielded while the requests still run."""
    config = EmulatorConfig(model="m", max_running=1, decode_tps=20.0, time_scale=10.0)
    pool = BackendPool(load_unit="requests")
    async with (
        run_emulator(config) as url,
        ClientSession() as session,
        UpstreamClient() as client,
    ):
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
        await MetricsPoller(signals, client, sample=2, timeout_s=0.5).poll_once()
        try:
            yield pool
        finally:
            for response in await asyncio.gather(*tasks):
                response.release()
