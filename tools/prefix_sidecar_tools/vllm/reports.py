"""Read what a real vLLM pod itself reports: token counts from /tokenize, cached_tokens from
a completion's usage, prefix-cache counters and the block size from /metrics.

Why here and not the sidecar's own readers: the vLLM tests and benches judge the sidecar by
the engine's figures, so they must not go through the code under test.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
CACHE_INFO = "vllm:cache_config_info"
# `name{labels} value`: the samples we read carry labels (engine, model_name).
_SAMPLE = re.compile(r"^(vllm:[A-Za-z0-9_:]+)\{([^}]*)\} (\S+)", re.MULTILINE)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="([^"]*)"')


@dataclass(frozen=True)
class CacheCounters:
    """A pod's prefix-cache counters (in tokens, since its start) and its KV geometry."""

    queries: float
    hits: float
    block_size: int
    kv_tokens: int

    def hit_rate_since(self, before: CacheCounters) -> float:
        queried = self.queries - before.queries
        return (self.hits - before.hits) / queried if queried else 0.0


def parse_cache_counters(text: str) -> CacheCounters:
    """The counters from a /metrics page; summed over engines (data parallel)."""
    queries = hits = 0.0
    block_size = kv_tokens = 0
    for name, labels, value in _SAMPLE.findall(text):
        if name == QUERIES:
            queries += float(value)
        elif name == HITS:
            hits += float(value)
        elif name == CACHE_INFO:
            found = dict(_LABEL.findall(labels))
            block_size = int(found["block_size"])
            kv_tokens += int(found["num_gpu_blocks"]) * block_size
    if not block_size:
        raise ValueError(f"no {CACHE_INFO} sample with a block_size on this page")
    return CacheCounters(queries, hits, block_size, kv_tokens)


async def cache_counters(session: aiohttp.ClientSession, url: str) -> CacheCounters:
    async with session.get(f"{url}/metrics") as resp:
        resp.raise_for_status()
        return parse_cache_counters(await resp.text())


async def tokenize(session: aiohttp.ClientSession, url: str, model: str, prompt: str) -> list[int]:
    """The pod's own token ids of `prompt` (POST /tokenize)."""
    async with session.post(f"{url}/tokenize", json={"model": model, "prompt": prompt}) as resp:
        resp.raise_for_status()
        return list((await resp.json())["tokens"])


async def complete(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int = 1
) -> dict[str, Any]:
    """A non-streamed greedy /v1/completions straight to the pod; its JSON answer."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        answer: dict[str, Any] = await resp.json()
        return answer


def cached_tokens(usage: Mapping[str, Any] | None) -> int:
    """`usage.prompt_tokens_details.cached_tokens` as vLLM reports it (0 when absent)."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def whole_blocks(tokens: int, block_size: int) -> int:
    """The tokens of `tokens` that fill whole blocks: all a prefix cache can hold of them."""
    return tokens // block_size * block_size


def common_length(left: Sequence[int], right: Sequence[int]) -> int:
    """How many leading ids (tokens, block hashes) two sequences share."""
    shared = 0
    for a, b in zip(left, right, strict=False):
        if a != b:
            break
        shared += 1
    return shared
