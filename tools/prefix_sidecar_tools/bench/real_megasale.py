"""The mega-sale workload of `bench real --engine vllm`: a few fat registered prefixes (the
sale's rules, 4k-16k tokens of the tiny model's tokenizer) and thin queries, Poisson
arrivals, Zipf popularity over the prefixes.

Why it is built as an organic trace of one-request flows: the organic bench's replay,
streaming POST and result record then send it unchanged, to a pod, the sidecar's HTTP
front or SGLang's router alike, so every system gets the same bodies at the same times.

The ceiling (what whole-block caching allows, whatever the router): a request's prefix is
P tokens (the pod's own /tokenize) and a prefix cache holds whole blocks of B tokens only,
so at most floor(P / B) x B of its prompt can come from the cache; the first request of
each prefix in the run must compute it (an ideal router with room for every prefix serves
every later one from the cache). Ceiling = those cached tokens over the prompt tokens of
all requests (vLLM's usage.prompt_tokens).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from prefix_sidecar_tools.bench.organic_driver import Result
from prefix_sidecar_tools.bench.organic_trace import Flow, OrganicRequest, OrganicTrace, TraceParams
from prefix_sidecar_tools.vllm.reports import tokenize, whole_blocks
from prefix_sidecar_tools.vllm.tiny_model import document
from prefix_sidecar_tools.workload.trace import zipf_weights

KIND = "registered"
TOKENS_PER_WORD = 1.21  # the tiny model's tokenizer on its own documents (a first guess)
QUERY_WORDS = 12


@dataclass(frozen=True)
class MegasaleParams:
    seed: int = 0
    prefixes: int = 8
    min_tokens: int = 4096
    max_tokens: int = 16384
    requests: int = 120
    rate: float = 4.0  # requests per second, Poisson
    zipf: float = 1.0

    def validate(self) -> None:
        if self.prefixes < 1 or self.requests < 1:
            raise ValueError("need at least one prefix and one request")
        if not 0 < self.min_tokens <= self.max_tokens:
            raise ValueError("need 0 < min prefix tokens <= max prefix tokens")
        if self.rate <= 0:
            raise ValueError("the arrival rate must be > 0")


@dataclass(frozen=True)
class Prefix:
    name: str
    text: str
    tokens: int  # as the pods tokenize it


def target_sizes(params: MegasaleParams) -> list[int]:
    """Prefix sizes spread evenly over [min, max] tokens, dealt to the Zipf ranks in a
    seeded order (so the most popular prefix is not always the shortest)."""
    count = params.prefixes
    step = (params.max_tokens - params.min_tokens) / max(1, count - 1)
    sizes = [round(params.min_tokens + i * step) for i in range(count)]
    random.Random(f"megasale-sizes-{params.seed}").shuffle(sizes)
    return sizes


async def build_prefixes(
    session: aiohttp.ClientSession, url: str, model: str, params: MegasaleParams
) -> list[Prefix]:
    """Each prefix's text, sized by the pod's tokenizer to within a few tokens of its target:
    one guess from the words-per-token ratio, then one correction."""

    async def one(index: int, target: int) -> Prefix:
        key = f"megasale-{params.seed}-{index}"
        words = max(8, round(target / TOKENS_PER_WORD))
        count = len(await tokenize(session, url, model, document(key, words)))
        words = max(8, round(words * target / count))
        text = document(key, words)
        return Prefix(f"sale-{index}", text, len(await tokenize(session, url, model, text)))

    sizes = target_sizes(params)
    return list(await asyncio.gather(*(one(i, size) for i, size in enumerate(sizes))))


def query_text(rng: random.Random, seq: int) -> str:
    """A thin query; it starts on a new line, after the prefix's closing full stop."""
    words = " ".join(document(f"query-{rng.random()}", QUERY_WORDS).split())
    return f"\nQuestion {seq}: {words}\nAnswer:"


def build_trace(params: MegasaleParams, prefixes: Sequence[Prefix]) -> OrganicTrace:
    """Poisson arrivals at `rate`, each request prefix + a new query, the prefix drawn by
    Zipf rank (prefix 0 the most popular). Seeded: the same params, the same bytes."""
    params.validate()
    rng = random.Random(f"megasale-{params.seed}")
    weights = zipf_weights(len(prefixes), params.zipf)
    at = 0.0
    requests: list[OrganicRequest] = []
    for seq in range(params.requests):
        at += rng.expovariate(params.rate)
        owner = rng.choices(range(len(prefixes)), weights)[0]
        prompt = prefixes[owner].text + query_text(rng, seq)
        requests.append(OrganicRequest(seq, KIND, owner, seq, 0, (), prompt, 0.0, at))
    flows = [Flow(r.seq, r.nominal_at, (r,)) for r in requests]
    return OrganicTrace(TraceParams(seed=params.seed), flows, requests)


@dataclass(frozen=True)
class Ceiling:
    prompt_tokens: int  # over the answered requests, from vLLM's usage
    cached_tokens: int  # what whole-block caching allows them

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def ceiling(
    trace: OrganicTrace, results: Sequence[Result], prefixes: Sequence[Prefix], block_size: int
) -> Ceiling:
    """The whole-block ceiling over the answered requests (module docstring); a prefix's
    first request in the trace is its one miss."""
    seen: set[int] = set()
    prompt = cached = 0
    for request, result in zip(trace.requests, results, strict=True):
        first = request.owner not in seen
        seen.add(request.owner)
        if not result.ok:
            continue
        prompt += result.prompt_tokens
        if not first:
            cached += whole_blocks(prefixes[request.owner].tokens, block_size)
    return Ceiling(prompt, cached)


def organic_ceiling(token_ids: Sequence[Sequence[int]], block_size: int) -> Ceiling:
    """The organic trace's infinite-cache ceiling: one cache of whole blocks sees the
    prompts (their pod-side token ids) in trace order, and serves each the leading blocks
    seen before; a prompt wholly cached still recomputes its last token, as vLLM does."""
    seen: set[int] = set()
    prompt = cached = 0
    for ids in token_ids:
        prompt += len(ids)
        key, hit, leading = 0, 0, True
        for start in range(0, len(ids) - block_size + 1, block_size):
            key = hash((key, tuple(ids[start : start + block_size])))
            if leading and key in seen:
                hit += block_size
            else:
                leading = False
            seen.add(key)
        cached += min(hit, max(0, len(ids) - 1) // block_size * block_size)
    return Ceiling(prompt, cached)


def kv_tokens_for(sizes: Sequence[int], share: float, block_size: int) -> int:
    """A pod's KV budget from the prefixes' target sizes: `share` of all their tokens (so
    they cannot all fit in one pod when share < 1), never less than the largest plus four
    blocks (vLLM wants a whole max_model_len sequence to fit, with blocks to spare, and the
    largest prompt is its prefix, a query and a few tokens of sizing error). Targets, not
    /tokenize counts: the pods need the budget before they start."""
    wanted = max(round(sum(sizes) * share), max(sizes) + 4 * block_size)
    return -(-wanted // block_size) * block_size
