"""`--from-metrics URL`: the hit rate a running sidecar measures, or a vLLM pod's KV budget and
prefix-cache hit rate, read from its /metrics.

A sidecar's page: it counts, per prefix name, the prompt tokens the pods reported and those
they served from cache (`prefix_sidecar_prompt_tokens_total`, `prefix_sidecar_cached_tokens_total`,
prefix_sidecar/metrics.py). cached / prompt is a prompt-token rate; the planner wants the prefix-
token rate, so the prompt tokens are scaled by prefix / (prefix + query) of that prefix
(cache hits inside a query are rare: queries are unique).

A sidecar with kv_events also says when its pods are too small for the registered prefixes
they are home to: losses it did not refill (`prefix_sidecar_reprewarms_total`, reasons
no_room and throttled). The plan's source line says so, with what to change.

A vLLM pod's page (no sidecar counters, a `vllm:cache_config_info`): the pod's KV budget is
`kv_cache_size_tokens` (else num_gpu_blocks x block_size), and its own prefix-cache counters
(`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, prompt tokens) give one
hit rate for the whole mix, scaled to prefix tokens as above. A pod that has served nothing
still gives its KV budget.

The endpoint is untrusted: one GET, no redirects, a time limit and a size limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from prefix_sidecar_tools.plan.scenario import Scenario, ScenarioError

MAX_BYTES = 4 * 1024 * 1024
TIMEOUT_S = 5.0
_SAMPLE = re.compile(
    r'^(prefix_sidecar_(?:prompt|cached)_tokens)_total\{prefix="((?:[^"\\]|\\.)*)"\}\s+(\S+)'
)


_TOO_SMALL = re.compile(r'^prefix_sidecar_reprewarms_total\{reason="(no_room|throttled)"\}\s+(\S+)')
_POD_SAMPLE = re.compile(
    r"^(vllm:prefix_cache_queries_total|vllm:prefix_cache_hits_total|vllm:cache_config_info)"
    r"(?:\{([^}]{0,8192})\})?\s+(\S+)"
)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
MAX_KV_TOKENS = 1 << 40


class MetricsError(ScenarioError):
    """The metrics could not be read or hold no usable counters."""


async def fetch(url: str, *, max_bytes: int = MAX_BYTES, timeout_s: float = TIMEOUT_S) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MetricsError(f"--from-metrics wants an http(s) URL, got {url!r}")
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url, allow_redirects=False) as response,
        ):
            if response.status != 200:
                raise MetricsError(f"{url} answered HTTP {response.status}, not 200 (no redirects)")
            body = bytearray()
            async for chunk in response.content.iter_chunked(64 * 1024):
                body += chunk
                if len(body) > max_bytes:
                    raise MetricsError(f"{url} sent more than {max_bytes} bytes of metrics")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise MetricsError(f"cannot read {url}: {type(exc).__name__}: {exc}") from None
    return body.decode("utf-8", errors="replace")


def parse(text: str) -> dict[str, tuple[float, float]]:
    """prefix name -> (prompt tokens, cached tokens)."""
    counts: dict[str, list[float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        metric, name, raw = match.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            continue
        slot = counts.setdefault(name.replace('\\"', '"').replace("\\\\", "\\"), [0.0, 0.0])
        slot[0 if metric.endswith("prompt_tokens") else 1] += value
    return {name: (prompt, cached) for name, (prompt, cached) in counts.items()}


def too_small(text: str) -> str:
    """What a sidecar's page says of pods too small for their homes ("" when nothing)."""
    counts = {"no_room": 0.0, "throttled": 0.0}
    for line in text.splitlines():
        match = _TOO_SMALL.match(line)
        if match is not None:
            counts[match[1]] += _count(match[2])
    if not any(counts.values()):
        return ""
    return (
        f"; pods too small for the prefixes they are home to: {counts['no_room']:,.0f} "
        f"losses without room and {counts['throttled']:,.0f} thrashing "
        "(prefix_sidecar_reprewarms_total): more KV per pod, or more pods"
    )


@dataclass(frozen=True)
class PodCache:
    """What a vLLM pod's /metrics says of its cache: its KV size and its prefix-cache
    counters (prompt tokens looked up and found, since it started)."""

    kv_tokens: int
    block_size: int
    queries: float
    hits: float


def _count(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) and value >= 0 else 0.0


def _kv_of(labels: dict[str, str]) -> tuple[int, int] | None:
    """(KV tokens, block size) from cache_config_info's labels, or None if they do not say."""
    size, blocks = labels.get("block_size", ""), labels.get("num_gpu_blocks", "")
    tokens = labels.get("kv_cache_size_tokens", "")
    if not (size.isdigit() and 0 < int(size) <= 1 << 20):
        return None
    if tokens.isdigit() and len(tokens) <= 13:
        kv = int(tokens)
    elif blocks.isdigit() and len(blocks) <= 12:
        kv = int(blocks) * int(size)
    else:
        return None
    return (kv, int(size)) if 0 < kv <= MAX_KV_TOKENS else None


def parse_pod(text: str) -> PodCache | None:
    """A vLLM pod's cache from its /metrics page; None if the page has no usable
    `vllm:cache_config_info`. Several engines (data parallel) add their counters; the KV
    budget is the smallest engine's, as the sidecar reads it."""
    kv: tuple[int, int] | None = None
    queries = hits = 0.0
    for line in text.splitlines():
        match = _POD_SAMPLE.match(line)
        if match is None:
            continue
        name, labels, raw = match.groups()
        if name == "vllm:cache_config_info":
            found = _kv_of(dict(_LABEL.findall(labels or "")))
            if found is not None and (kv is None or found[0] < kv[0]):
                kv = found
        elif name == "vllm:prefix_cache_queries_total":
            queries += _count(raw)
        else:
            hits += _count(raw)
    if kv is None:
        return None
    return PodCache(kv[0], kv[1], queries, min(hits, queries))


def apply_pod(scenario: Scenario, pod: PodCache, url: str) -> Scenario:
    """The pod's KV budget, and its hit rate (prompt tokens scaled to prefix tokens) if it
    has served anything."""
    scenario = dataclasses.replace(
        scenario, pod=dataclasses.replace(scenario.pod, kv_tokens=pod.kv_tokens)
    )
    source = (
        f"{url} (vLLM pod: {pod.kv_tokens:,} KV tokens in blocks of {pod.block_size}; "
        f"prefix cache {pod.hits:,.0f} of {pod.queries:,.0f} prompt tokens)"
    )
    overall = None
    if pod.queries > 0:
        prefix = scenario.mean_prefix_tokens()
        share = prefix / (prefix + scenario.traffic.query_tokens)
        overall = min(1.0, pod.hits / (pod.queries * share))
    return scenario.with_hit_rates({}, overall, source)


def hit_rates(
    scenario: Scenario, counts: dict[str, tuple[float, float]]
) -> tuple[dict[str, float], float]:
    """Per-prefix prefix-token hit rates for the scenario's prefixes, and the overall rate."""
    t = scenario.traffic
    by_name = {p.name: p for p in t.prefixes}
    mean_prefix = scenario.mean_prefix_tokens()
    rates: dict[str, float] = {}
    cached_total = prefix_total = 0.0
    for name, (prompt, cached) in counts.items():
        tokens = by_name[name].tokens if name in by_name else mean_prefix
        share = tokens / (tokens + t.query_tokens)
        cached_total += min(cached, prompt)
        prefix_total += prompt * share
        if name in by_name and prompt > 0:
            rates[name] = min(1.0, cached / (prompt * share))
    if prefix_total <= 0:
        raise MetricsError(
            "the metrics hold no prompt tokens (prefix_sidecar_prompt_tokens_total): "
            "the sidecar has served nothing yet, so it has no hit rate to give"
        )
    return rates, min(1.0, cached_total / prefix_total)


def apply(scenario: Scenario, url: str) -> Scenario:
    """A sidecar's page gives per-prefix hit rates; a vLLM pod's its KV and its hit rate."""
    text = asyncio.run(fetch(url))
    counts = parse(text)
    pod = None if counts else parse_pod(text)
    if pod is not None:
        return apply_pod(scenario, pod, url)
    rates, overall = hit_rates(scenario, counts)
    source = f"{url} ({len(counts)} prefixes){too_small(text)}"
    return scenario.with_hit_rates(rates, overall, source)
