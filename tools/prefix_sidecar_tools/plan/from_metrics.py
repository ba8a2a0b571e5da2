"""`--from-metrics URL`: the hit rate a running sidecar measures, read from its /metrics.

The sidecar counts, per prefix name, the prompt tokens the pods reported and those they
served from cache (`prefix_sidecar_prompt_tokens_total`, `prefix_sidecar_cached_tokens_total`,
prefix_sidecar/metrics.py). cached / prompt is a prompt-token rate; the planner wants the prefix-
token rate, so the prompt tokens are scaled by prefix / (prefix + query) of that prefix
(cache hits inside a query are rare: queries are unique). The endpoint is untrusted: one GET,
no redirects, a time limit and a size limit.
"""

from __future__ import annotations

import asyncio
import math
import re
from urllib.parse import urlsplit

import aiohttp

from prefix_sidecar_tools.plan.scenario import Scenario, ScenarioError

MAX_BYTES = 4 * 1024 * 1024
TIMEOUT_S = 5.0
_SAMPLE = re.compile(
    r'^(prefix_sidecar_(?:prompt|cached)_tokens)_total\{prefix="((?:[^"\\]|\\.)*)"\}\s+(\S+)'
)


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
    counts = parse(asyncio.run(fetch(url)))
    rates, overall = hit_rates(scenario, counts)
    return scenario.with_hit_rates(rates, overall, f"{url} ({len(counts)} prefixes)")
