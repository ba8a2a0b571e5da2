"""What `bench real --engine vllm` reports for one system on one workload, read from vLLM.

Why from the pods: the hit rate that counts is the engine's, so each pod's /metrics is
scraped before and after a system's run and the deltas of `vllm:prefix_cache_hits_total`
over `vllm:prefix_cache_queries_total` (tokens, every prompt the pods were sent, a
sidecar's prewarm included) give the hit rate; `vllm:request_success_total` gives the
requests per pod (a router that does not say where it sent a request, SGLang's, included).
Beside it, the per-request figure: usage.prompt_tokens_details.cached_tokens over
usage.prompt_tokens of the answered requests.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from prefix_sidecar_tools.bench.organic_driver import Result, metric_samples
from prefix_sidecar_tools.bench.real_megasale import Ceiling
from prefix_sidecar_tools.cost import CostParams, daily_cost
from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.vllm.reports import parse_cache_counters

REQUESTS = "vllm:request_success_total"
MAX_ERRORS_SHOWN = 5


@dataclass(frozen=True)
class PodCounters:
    queries: float
    hits: float
    requests: float


async def scrape(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[PodCounters]:
    """Every pod's prefix-cache and request counters, in fleet order."""

    async def one(url: str) -> PodCounters:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            r.raise_for_status()
            text = await r.text()
        cache = parse_cache_counters(text)
        requests = sum(value for _, value in metric_samples(text, REQUESTS))
        return PodCounters(cache.queries, cache.hits, requests)

    return list(await asyncio.gather(*(one(url) for url in urls)))


def _ms(values: Sequence[float], q: float) -> float:
    return percentile(values, q) * 1e3 if values else math.nan


def summarize(
    results: Sequence[Result],
    before: Sequence[PodCounters],
    after: Sequence[PodCounters],
    elapsed_s: float,
    ceiling: Ceiling | None = None,
) -> dict[str, Any]:
    """One row of a table: hit rates (vLLM's counters, per-request usage), TTFT, requests
    per pod, errors, and docs/mission.md's cost per day at the counters' hit rate."""
    pairs = list(zip(after, before, strict=True))
    queries = sum(a.queries - b.queries for a, b in pairs)
    hits = sum(a.hits - b.hits for a, b in pairs)
    answered = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in answered)
    cached = sum(r.cached_tokens for r in answered)
    ttfts = [r.ttft_s for r in answered]
    hit_rate = hits / queries if queries else 0.0
    errors = [f"{r.seq}: {r.error}" for r in results if not r.ok]
    row: dict[str, Any] = {
        "requests": len(results),
        "errors": len(errors),
        "error_samples": errors[:MAX_ERRORS_SHOWN],
        "hit_rate": hit_rate,  # vLLM's counters: hits / queries, tokens
        "queried_tokens": queries,
        "hit_tokens": hits,
        "usage_hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50_ms": _ms(ttfts, 50),
        "ttft_p99_ms": _ms(ttfts, 99),
        "requests_per_pod": [round(a.requests - b.requests) for a, b in pairs],
        "elapsed_s": elapsed_s,
        "yuan_per_day": daily_cost(CostParams(), min(1.0, max(0.0, hit_rate))).cached,
    }
    if ceiling is not None:
        row["ceiling"] = ceiling.hit_rate
        row["of_ceiling"] = hit_rate / ceiling.hit_rate if ceiling.hit_rate else 0.0
    return row


def per_request(
    results: Sequence[Result], owners: Sequence[int], urls: Sequence[str]
) -> list[list[Any]]:
    """[seq, prefix (or tenant/template: the request's owner), pod index (-1: not known to
    the client), prompt tokens, cached tokens, TTFT ms, error] per request: why a system
    missed, request by request."""
    index = {url: i for i, url in enumerate(urls)}
    return [
        [
            r.seq,
            owner,
            index.get(r.backend.rstrip("/"), -1),
            r.prompt_tokens,
            r.cached_tokens,
            round(r.ttft_s * 1e3, 1) if r.ok else None,
            r.error,
        ]
        for r, owner in zip(results, owners, strict=True)
    ]


def _registered_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    header = (
        f"{'system':<13}{'n':>4}{'err':>4}{'hit':>7}{'usage':>7}{'ceil':>6}{'of ceil':>8}"
        f"{'p50 ms':>8}{'p99 ms':>8}  {'per pod':<16}{'yuan/day':>10}"
    )
    lines = ["registered prefixes (mega-sale)", header, "-" * len(header)]
    for name, row in rows.items():
        pods = "/".join(str(n) for n in row["requests_per_pod"])
        lines.append(
            f"{name:<13}{row['requests']:>4}{row['errors']:>4}{row['hit_rate']:>7.3f}"
            f"{row['usage_hit_rate']:>7.3f}{row.get('ceiling', math.nan):>6.3f}"
            f"{row.get('of_ceiling', math.nan):>8.3f}{row['ttft_p50_ms']:>8.1f}"
            f"{row['ttft_p99_ms']:>8.1f}  {pods:<16}{row['yuan_per_day']:>10,.0f}"
        )
    return lines


def _organic_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    header = (
        f"{'system':<13}{'n':>4}{'err':>4}{'hit':>7}{'usage':>7}{'ceil':>6}{'of ceil':>8}"
        f"{'p50 ms':>8}{'p99 ms':>8}"
    )
    lines = ["organic (bench organic's trace; ceil: one infinite cache)", header]
    lines.append("-" * len(header))
    for name, row in rows.items():
        lines.append(
            f"{name:<13}{row['requests']:>4}{row['errors']:>4}{row['hit_rate']:>7.3f}"
            f"{row['usage_hit_rate']:>7.3f}{row.get('ceiling', math.nan):>6.3f}"
            f"{row.get('of_ceiling', math.nan):>8.3f}{row['ttft_p50_ms']:>8.1f}"
            f"{row['ttft_p99_ms']:>8.1f}"
        )
    return lines


def side_by_side(left: list[str], right: list[str], gap: int = 4) -> list[str]:
    width = max((len(line) for line in left), default=0)
    blank = " " * width
    pairs = [
        (left[i] if i < len(left) else blank, right[i] if i < len(right) else "")
        for i in range(max(len(left), len(right)))
    ]
    return [f"{a:<{width}}{' ' * gap}{b}".rstrip() for a, b in pairs]


def _niceness(fleet: dict[str, Any]) -> str:
    nice = fleet.get("nice", 0)
    return f", pods at CPU niceness {nice} (the routers at 0)" if nice else ""


def render(report: dict[str, Any]) -> str:
    """Both tables side by side, then the settings that made them."""
    tables = report["workloads"]
    left = _registered_lines(tables["registered"]) if tables.get("registered") else []
    right = _organic_lines(tables["organic"]) if tables.get("organic") else []
    fleet = report["fleet"]
    params = CostParams()
    lines = [
        f"real vLLM: {fleet['pods']} pods, KV {fleet['kv_tokens']:,} tokens each (block "
        f"{fleet['block_size']}), prefixes {fleet['prefix_tokens']} tokens "
        f"(sum {sum(fleet['prefix_tokens']):,}), pods made cold by {fleet['cold']} "
        f"between systems{_niceness(fleet)}, {report['elapsed_s']:.0f} s in all",
        "hit: vLLM's prefix_cache hits/queries (tokens, prewarm included); usage: "
        "cached_tokens/prompt_tokens per request; ceil: whole-block ceiling; p50/p99: TTFT",
        f"yuan/day: docs/mission.md's model ({params.requests_per_day:,.0f} requests of a "
        f"{params.prefix_tokens:,.0f}-token prefix) at the measured hit rate",
        "",
        *(side_by_side(left, right) if left and right else left or right),
        *_decision_lines(tables),
    ]
    return "\n".join(lines)


def _decision_lines(tables: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The sidecar systems' time to choose a pod, from their request logs."""
    timed = [
        f"{workload}/{name} p50 {d['p50']:.1f} p99 {d['p99']:.1f} max {d['max']:.1f} (n {d['n']})"
        for workload, rows in tables.items()
        for name, row in (rows or {}).items()
        if (d := row.get("decision_ms"))
    ]
    return ["", "sidecar routing decisions, ms: " + "; ".join(timed)] if timed else []
