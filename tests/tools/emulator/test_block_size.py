"""`--block-size`: the emulator caches and reports in blocks of any size, as vLLM does (128
on CPU, 16 on GPUs), and a request's cached_tokens is whole blocks of that size."""

from __future__ import annotations

import argparse

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator
from prefix_sidecar_tools.emulator.config import add_config_arguments, config_from_args
from prefix_sidecar_tools.emulator.prefix_cache import PrefixCache
from prefix_sidecar_tools.emulator.tokenizer import block_hashes

from .conftest import prompt_of_tokens


def test_blocks_are_hashed_and_counted_at_the_configured_size() -> None:
    data = b"abcd" * 300  # 300 tokens: two whole blocks of 128, eighteen of 16
    assert len(block_hashes(data, 128)) == 2
    assert len(block_hashes(data)) == 18
    assert block_hashes(data, 128) != block_hashes(data)[:2]  # a block is its own slice
    cache = PrefixCache(4, block_size=128)
    chain = block_hashes(data, 128)
    cache.allocate(chain)
    assert cache.hit_blocks(chain, 300) == 2
    assert cache.hit_blocks(chain, 256) == 1  # the last token is always recomputed


async def test_a_prompt_sent_twice_is_cached_in_whole_blocks(
    session: aiohttp.ClientSession,
) -> None:
    config = EmulatorConfig(model="m", block_size=128, kv_tokens=8192, time_scale=1000.0)
    body = {"prompt": prompt_of_tokens(2000), "max_tokens": 1}
    cached = []
    async with run_emulator(config) as url:
        for _ in range(2):
            async with session.post(url + "/v1/completions", json=body) as response:
                usage = (await response.json())["usage"]
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        async with session.get(url + "/metrics") as response:
            families = {f.name: f for f in text_string_to_metric_families(await response.text())}
    assert cached == [0, 1920]  # 2,000 tokens: 15 whole blocks, as vLLM gives it
    (info,) = families["vllm:cache_config_info"].samples
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"]) == ("128", "64")
    assert info.labels["kv_cache_size_tokens"] == "8192"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--block-size", "0"], "block_size must be in 1..16384"),
        (["--block-size", "128", "--kv-tokens", "100"], r"at least one block \(128 tokens\)"),
    ],
)
def test_bad_block_sizes_are_refused(flags: list[str], message: str) -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    with pytest.raises(ValueError, match=message):
        config_from_args(parser.parse_args(flags))
