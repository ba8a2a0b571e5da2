"""The shared real-engine workload: fat prefixes, thin queries, TTFT per request.

Mirrors the mission's traffic at toy scale: a few long shared prefixes (the "rules"
prompts, ~2,000 tokens here instead of 60k) and a short new suffix per request (the
merchant's query). `run_workload` sends requests one at a time over aiohttp streaming,
times the first SSE event (TTFT), and reads from the chosen pod's log what the pod
evaluated versus reused, so a result says both how fast and why.

Routing is a hook: `RouteFn(request, seq) -> awaitable pod URL`. `round_robin` and
`affinity` are the baselines; the sidecar policy plugs in as another RouteFn.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from sidecar.realengine.gguf_model import WORDS
from sidecar.realengine.pods import LlamaFleet, PromptEval


@dataclass(frozen=True)
class Request:
    seq: int
    prefix_id: int
    prompt: str


@dataclass
class Result:
    request: Request
    url: str
    ttft_ms: float
    total_ms: float
    text: str
    evals: list[PromptEval] = field(default_factory=list)  # exactly one when sequential

    @property
    def evaluated(self) -> int | None:
        return self.evals[0].evaluated if len(self.evals) == 1 else None

    @property
    def reused(self) -> int | None:
        return self.evals[0].reused if len(self.evals) == 1 else None


RouteFn = Callable[[Request, int], Awaitable[str]]


def prefix_text(prefix_id: int, words: int = 2000, seed: int = 0) -> str:
    """A deterministic "rules" prompt; with the default vocab each word is one token."""
    rng = random.Random(f"prefix-{seed}-{prefix_id}")
    body = " ".join(rng.choice(WORDS) for _ in range(words - 4))
    return f"rules {prefix_id}: {body}"


def suffix_text(seq: int, words: int = 16, seed: int = 0) -> str:
    rng = random.Random(f"suffix-{seed}-{seq}")
    return " query " + " ".join(rng.choice(WORDS) for _ in range(words))


def build_requests(
    n_prefixes: int,
    rounds: int,
    *,
    prefix_words: int = 2000,
    suffix_words: int = 16,
    seed: int = 0,
) -> list[Request]:
    """`rounds` rounds, each sending every prefix once in a seeded shuffled order.

    Shuffled so that round-robin over pods does not line up with the prefix order by
    accident (with a fixed order and n_prefixes == pods it would equal affinity).
    """
    if n_prefixes < 1 or rounds < 1:
        raise ValueError("need n_prefixes >= 1 and rounds >= 1")
    prefixes = [prefix_text(i, prefix_words, seed) for i in range(n_prefixes)]
    order_rng = random.Random(f"order-{seed}")
    requests: list[Request] = []
    for _ in range(rounds):
        ids = list(range(n_prefixes))
        order_rng.shuffle(ids)
        for prefix_id in ids:
            seq = len(requests)
            prompt = prefixes[prefix_id] + suffix_text(seq, suffix_words, seed)
            requests.append(Request(seq=seq, prefix_id=prefix_id, prompt=prompt))
    return requests


def round_robin(urls: Sequence[str]) -> RouteFn:
    async def route(request: Request, seq: int) -> str:
        return urls[seq % len(urls)]

    return route


def affinity(urls: Sequence[str]) -> RouteFn:
    """Oracle placement: prefix i always on pod i mod N (what the sidecar approximates)."""

    async def route(request: Request, seq: int) -> str:
        return urls[request.prefix_id % len(urls)]

    return route


async def stream_completion(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 4
) -> tuple[float, float, str]:
    """POST a streaming /v1/completions; return (ttft_ms, total_ms, text).

    TTFT is the first SSE data event: llama.cpp emits it after the prompt is evaluated
    and the first token sampled, so it measures prefill + one decode step.
    """
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    start = time.perf_counter()
    ttft: float | None = None
    pieces: list[str] = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            pieces.append(json.loads(payload)["choices"][0].get("text") or "")
    total = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError(
            f"{url} closed the stream without a data event (an error in the pod log?)"
        )
    return ttft * 1e3, total * 1e3, "".join(pieces)


async def run_workload(
    fleet: LlamaFleet,
    requests: Sequence[Request],
    route: RouteFn,
    *,
    max_tokens: int = 4,
    session: aiohttp.ClientSession | None = None,
) -> list[Result]:
    """Send requests one after another to route(...)'s pod; attach the pod's log record.

    Sequential on purpose: TTFT then measures the cache effect, not queueing on 2 cores,
    and each pod log slice holds exactly this request's record.
    """
    own = session is None
    session = session or aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    results: list[Result] = []
    try:
        for seq, request in enumerate(requests):
            url = await route(request, seq)
            pod = fleet.pod_for(url)
            mark = pod.log_offset()
            ttft, total, text = await stream_completion(session, url, request.prompt, max_tokens)
            results.append(Result(request, pod.url, ttft, total, text, pod.prompt_evals(mark)))
    finally:
        if own:
            await session.close()
    return results


async def count_tokens(session: aiohttp.ClientSession, url: str, text: str) -> int:
    """Ask a pod how many tokens `text` is (its /extras/tokenize/count endpoint)."""
    async with session.post(f"{url}/extras/tokenize/count", json={"input": text}) as resp:
        resp.raise_for_status()
        return int((await resp.json())["count"])


@dataclass(frozen=True)
class Summary:
    requests: int
    median_ttft_ms: float
    p90_ttft_ms: float
    evaluated_tokens: int
    reused_tokens: int

    @property
    def reuse_ratio(self) -> float:
        """Share of prompt tokens served from a KV cache: the prefix-token hit rate."""
        total = self.evaluated_tokens + self.reused_tokens
        return self.reused_tokens / total if total else 0.0

    def line(self, label: str) -> str:
        return (
            f"{label:<12} n={self.requests:<3} TTFT median {self.median_ttft_ms:7.1f} ms  "
            f"p90 {self.p90_ttft_ms:7.1f} ms  evaluated {self.evaluated_tokens:>6}  "
            f"reused {self.reused_tokens:>6}  reuse {self.reuse_ratio:6.1%}"
        )


def summarize(results: Sequence[Result]) -> Summary:
    if not results:
        raise ValueError("no results to summarize")
    ttfts = sorted(r.ttft_ms for r in results)
    return Summary(
        requests=len(results),
        median_ttft_ms=statistics.median(ttfts),
        p90_ttft_ms=ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        evaluated_tokens=sum(r.evaluated or 0 for r in results),
        reused_tokens=sum(r.reused or 0 for r in results),
    )


def evaluated_by_pod(results: Sequence[Result]) -> dict[str, dict[int, int]]:
    """{pod url: {prefix id: prompt tokens that pod evaluated for it}}."""
    table: dict[str, dict[int, int]] = {}
    for r in results:
        row = table.setdefault(r.url, {})
        row[r.request.prefix_id] = row.get(r.request.prefix_id, 0) + (r.evaluated or 0)
    return table
