"""The time model (prefill by uncached tokens, decode rate, queueing, KV waits, time scale)
and the Prometheus metrics that report it."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_sidecar_tools.emulator import EmulatorConfig, get_stats, run_emulator

from .conftest import post, prompt_of_tokens


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            continue  # labelled by the cache config, not the model (tests/.../test_load_report)
        for sample in family.samples:
            assert sample.labels.get("model_name") == "m"
            key = sample.name + (f"[{sample.labels['le']}]" if "le" in sample.labels else "")
            samples[key] = sample.value
    return samples


async def first_chunk_seconds(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 1
) -> float:
    start = time.perf_counter()
    async with session.post(
        url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    ) as response:
        await response.content.readuntil(b"\n\n")
        ttft = time.perf_counter() - start
        await response.read()
    return ttft


async def test_cold_prefix_costs_prefill_warm_does_not(session: aiohttp.ClientSession) -> None:
    config = EmulatorConfig(model="m", time_scale=20.0)  # defaults: 16k tok/s prefill
    shared = prompt_of_tokens(60_000)
    async with run_emulator(config) as url:
        cold = await first_chunk_seconds(session, url, shared + "merchant A asks")
        warm = await first_chunk_seconds(session, url, shared + "merchant B asks")
        metrics = await scrape(session, url)
    # modelled 3.76 s + 12 ms at scale 20 = 0.19 s real; warm: ~13 ms modelled = <1 ms real
    assert 0.17 < cold < 0.6, cold
    assert warm < 0.06, warm
    assert metrics["vllm:prefix_cache_queries_total"] == 2 * 60_004
    assert metrics["vllm:prefix_cache_hits_total"] == 60_000
    ttft_sum = metrics["vllm:time_to_first_token_seconds_sum"]
    assert 3.7 < ttft_sum < 3.77 + 2.0, ttft_sum  # MODELLED seconds, not real ones
    assert metrics["vllm:time_to_first_token_seconds_count"] == 2
    # the warm one: modelled ~13 ms, plus this machine's scheduling delay x 20 under load
    assert metrics["vllm:time_to_first_token_seconds_bucket[1.0]"] == 1
    assert metrics["vllm:time_to_first_token_seconds_bucket[5.0]"] == 2


@pytest.mark.timing
async def test_decode_rate_follows_decode_tps(session: aiohttp.ClientSession) -> None:
    config = EmulatorConfig(model="m", decode_tps=50.0, time_scale=10.0)
    async with run_emulator(config) as url:
        start = time.perf_counter()
        status, _ = await post(session, url, "/v1/completions", {"prompt": "x", "max_tokens": 51})
        elapsed = time.perf_counter() - start
    assert status == 200
    assert 0.09 < elapsed < 0.35, elapsed  # 50 tokens after the first at 500 tok/s real


async def test_running_limit_queues_fifo_and_gauges_show_it(session: aiohttp.ClientSession) -> None:
    config = EmulatorConfig(model="m", max_running=2, decode_tps=20.0, time_scale=10.0)
    async with run_emulator(config) as url:
        body = {"prompt": "same", "max_tokens": 11}  # 10 decode steps = 0.5 s modelled
        tasks = [asyncio.create_task(post(session, url, "/v1/completions", body)) for _ in range(4)]
        await asyncio.sleep(0.02)
        during = await scrape(session, url)
        results = await asyncio.gather(*tasks)
        after = await scrape(session, url)
        stats = await get_stats(url)
    assert all(status == 200 for status, _ in results)
    assert during["vllm:num_requests_running"] == 2
    assert during["vllm:num_requests_waiting"] == 2
    assert during["vllm:kv_cache_usage_perc"] == 0.0  # "same" has no full block to pin
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    # the second pair waited for the first: its modelled TTFT includes ~0.5 s of queueing
    assert after["vllm:time_to_first_token_seconds_bucket[0.25]"] == 2
    assert stats["completed"] == 4


async def test_kv_usage_gauge_counts_pinned_blocks(session: aiohttp.ClientSession) -> None:
    config = EmulatorConfig(model="m", kv_tokens=1600, decode_tps=10.0, time_scale=10.0)
    async with run_emulator(config) as url:
        task = asyncio.create_task(
            post(
                session, url, "/v1/completions", {"prompt": prompt_of_tokens(400), "max_tokens": 11}
            )
        )
        await asyncio.sleep(0.05)
        during = await scrape(session, url)
        await task
        after = await scrape(session, url)
    assert during["vllm:kv_cache_usage_perc"] == 0.25  # 25 of 100 blocks pinned
    assert after["vllm:kv_cache_usage_perc"] == 0.0  # released (still cached, evictable)


async def test_lru_eviction_at_capacity(session: aiohttp.ClientSession) -> None:
    config = EmulatorConfig(model="m", kv_tokens=1024, time_scale=1000.0)  # 64 blocks
    a, b = prompt_of_tokens(640, "aaaa") + "?", prompt_of_tokens(320, "bbbb") + "?"
    async with run_emulator(config) as url:
        for prompt in (a, b, a):  # 40 + 20 blocks fit in 64
            await post(session, url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        c = prompt_of_tokens(320, "cccc") + "?"  # 20 more: evicts the LRU (b) ...
        await post(session, url, "/v1/completions", {"prompt": c, "max_tokens": 1})
        _, again_b = await post(session, url, "/v1/completions", {"prompt": b, "max_tokens": 1})
        _, again_a = await post(session, url, "/v1/completions", {"prompt": a, "max_tokens": 1})
        stats = await get_stats(url)
    # c needed 20 blocks with 4 free: 16 evicted from b's tail, so b keeps 4 leading blocks
    assert again_b["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * 16
    assert again_a["usage"]["prompt_tokens_details"]["cached_tokens"] < 640
    assert stats["cache"]["evicted_blocks"] >= 16
    assert stats["cache"]["cached_blocks"] <= 64


async def test_full_kv_makes_requests_wait(session: aiohttp.ClientSession) -> None:
    config = EmulatorConfig(model="m", kv_tokens=1024, decode_tps=10.0, time_scale=10.0)
    async with run_emulator(config) as url:
        first = asyncio.create_task(
            post(
                session,
                url,
                "/v1/completions",
                {"prompt": prompt_of_tokens(800, "aaaa"), "max_tokens": 6},
            )
        )  # 0.5 s modelled decode
        await asyncio.sleep(0.005)
        start = time.perf_counter()
        second = asyncio.create_task(
            first_chunk_seconds(session, url, prompt_of_tokens(800, "bbbb"))
        )
        await asyncio.sleep(0.02)
        during = await scrape(session, url)
        ttft = await second
        await first
        status, too_big = await post(
            session, url, "/v1/completions", {"prompt": prompt_of_tokens(1100), "max_tokens": 1}
        )
    # 50 + 50 blocks > 64: the second waits until the first finishes (0.05 s real);
    # without the wait it would only queue behind the first's prefill (~0.013 s real)
    assert ttft > 0.04, (ttft, time.perf_counter() - start)
    # as vLLM counts them: the one holding KV runs, the one stalled for KV waits, although
    # both hold one of the pod's max_running seats
    assert during["vllm:num_requests_running"] == 1
    assert during["vllm:num_requests_waiting"] == 1
    assert status == 400 and "--kv-tokens" in too_big["error"]["message"]


async def test_time_scale_divides_real_time(session: aiohttp.ClientSession) -> None:
    timings = []
    for scale in (5.0, 50.0):
        config = EmulatorConfig(model="m", decode_tps=100.0, time_scale=scale)
        async with run_emulator(config) as url:
            start = time.perf_counter()
            await post(
                session,
                url,
                "/v1/completions",
                {"prompt": prompt_of_tokens(8000), "max_tokens": 21},
            )
            timings.append(time.perf_counter() - start)
    # modelled: 0.5 s prefill + 12 ms + 0.2 s decode = 0.71 s -> 0.142 s and 0.0142 s real
    assert 0.12 < timings[0] < 0.4, timings
    assert timings[1] < timings[0] / 4, timings
