"""The shared real-engine workload: fat prefixes, thin queries, TTFT per request.

Mirrors the mission's traffic at toy scale: a few long shared prefixes (the "rules"
prompts, ~2,000 tokens here instead of 60k) and a short new suffix per request (the
merchant's query). `run_workload` sends requests one at a time over aiohttp streaming,
times the first SSE event (TTFT), and reads from the chosen pod's log what the pod
evaluated versus reused, so a result says both how fast and why.

Routing is a hook at two levels. `RouteFn(request, seq) -> awaitable pod URL` picks a pod
and the request goes straight to it (`round_robin` and `affinity` are the baselines).
`SendFn(request, seq) -> awaitable Served` sends the request any way it likes and says which
pod served it: the sidecar's Complete RPC is one (`prefix_sidecar_tools.realengine.via_sidecar`).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.realengine.gguf_model import WORDS
from prefix_sidecar_tools.realengine.pods import LlamaFleet, PromptEval


@dataclass(frozen=True)
class Request:
    seq: int
    prefix_id: int  # index into the workload's prefixes: 0..n_prefixes-1
    prompt: str  # prefix + suffix
    suffix: str = ""  # the thin query; what a sidecar client sends as `input`

    @property
    def prefix(self) -> str:
        return self.prompt[: len(self.prompt) - len(self.suffix)]


@dataclass(frozen=True)
class Served:
    """What the client saw of one request: the pod that served it and its timings."""

    url: str
    ttft_ms: float
    total_ms: float
    text: str


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
SendFn = Callable[[Request, int], Awaitable[Served]]


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
    prefix_numbers: Sequence[int] | None = None,
) -> list[Request]:
    """`rounds` rounds, each sending every prefix once in a seeded shuffled order.

    Shuffled so that round-robin over pods does not line up with the prefix order by
    accident (with a fixed order and n_prefixes == pods it would equal affinity).
    Prefix i's text is prefix_text(prefix_numbers[i]) (default: i), so a caller can pick
    which texts make up the workload, e.g. ones whose home pods differ.
    """
    if n_prefixes < 1 or rounds < 1:
        raise ValueError("need n_prefixes >= 1 and rounds >= 1")
    numbers = list(range(n_prefixes)) if prefix_numbers is None else list(prefix_numbers)
    if len(numbers) != n_prefixes or len(set(numbers)) != n_prefixes:
        raise ValueError(f"prefix_numbers must be {n_prefixes} distinct numbers, got {numbers}")
    prefixes = [prefix_text(n, prefix_words, seed) for n in numbers]
    order_rng = random.Random(f"order-{seed}")
    requests: list[Request] = []
    for _ in range(rounds):
        ids = list(range(n_prefixes))
        order_rng.shuffle(ids)
        for prefix_id in ids:
            seq = len(requests)
            suffix = suffix_text(seq, suffix_words, seed)
            prompt = prefixes[prefix_id] + suffix
            requests.append(Request(seq=seq, prefix_id=prefix_id, prompt=prompt, suffix=suffix))
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


def direct(route: RouteFn, session: aiohttp.ClientSession, max_tokens: int = 4) -> SendFn:
    """A SendFn that asks `route` for a pod and streams the request straight to it."""

    async def send(request: Request, seq: int) -> Served:
        url = await route(request, seq)
        ttft, total, text = await stream_completion(session, url, request.prompt, max_tokens)
        return Served(url, ttft, total, text)

    return send


async def run_workload(
    fleet: LlamaFleet,
    requests: Sequence[Request],
    route: RouteFn | None = None,
    *,
    send: SendFn | None = None,
    max_tokens: int = 4,
    session: aiohttp.ClientSession | None = None,
) -> list[Result]:
    """Send requests one after another (via `send`, or straight to route(...)'s pod) and
    attach the serving pod's log record.

    Sequential on purpose: TTFT then measures the cache effect, not queueing on 2 cores,
    and each pod log slice holds exactly this request's record. Every pod's log is marked
    before a request, because with a SendFn the pod is known only once it has answered;
    a record on any other pod during the request is an error (something else used it).
    """
    own = session is None
    session = session or aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    if route is not None and send is None:
        sender = direct(route, session, max_tokens)
    elif send is not None and route is None:
        sender = send
    else:
        if own:
            await session.close()
        raise ValueError("run_workload needs exactly one of route or send")
    results: list[Result] = []
    try:
        for seq, request in enumerate(requests):
            marks = {pod.url: pod.log_offset() for pod in fleet.pods}
            served = await sender(request, seq)
            pod = fleet.pod_for(served.url)
            for other in fleet.pods:
                if other is not pod and other.prompt_evals(marks[other.url]):
                    raise RuntimeError(
                        f"request {seq} was served by {pod.url}, yet {other.url} evaluated "
                        "a prompt meanwhile: the log slices would not be this request's"
                    )
            results.append(
                Result(
                    request,
                    pod.url,
                    served.ttft_ms,
                    served.total_ms,
                    served.text,
                    pod.prompt_evals(marks[pod.url]),
                )
            )
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
    p99_ttft_ms: float
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
            f"p90 {self.p90_ttft_ms:7.1f} ms  p99 {self.p99_ttft_ms:7.1f} ms  "
            f"evaluated {self.evaluated_tokens:>6}  "
            f"reused {self.reused_tokens:>6}  reuse {self.reuse_ratio:6.1%}"
        )


def summarize(results: Sequence[Result]) -> Summary:
    if not results:
        raise ValueError("no results to summarize")
    ttfts = sorted(r.ttft_ms for r in results)
    return Summary(
        requests=len(results),
        median_ttft_ms=statistics.median(ttfts),
        p90_ttft_ms=percentile(ttfts, 90),
        p99_ttft_ms=percentile(ttfts, 99),
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
