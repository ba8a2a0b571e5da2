"""The fidelity trace and what one pod says to it (prefix_sidecar_tools.vllm.fidelity puts
two pods side by side).

The trace is what the sidecar sends: registered prefixes prewarmed then thin queries, and
organic chat sessions whose history is fixed in the trace (the same for every pod). Each
step goes to the pod alone, in order and non-streamed; its `cached_tokens` is kept beside
`ideal`, what a cache that never evicts would give on that pod's own tokenizer (whole blocks
shared with an earlier prompt, less the last token, which vLLM always recomputes). Then the
pod's /metrics, its load header asked in both formats and on a stream, the tail of a stream
with usage, and the keys of /tokenize.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from prefix_sidecar.membership.load_signals import FORMAT_HEADER, LOAD_HEADER
from prefix_sidecar_tools.vllm.reports import cached_tokens, common_length, whole_blocks
from prefix_sidecar_tools.vllm.tiny_model import document

PREFIX_WORDS = 1800  # ~2,170 vLLM tokens: 17 blocks of 128
SYSTEM_WORDS = 120
# What the sidecar reads from /metrics (membership/load_signals, plan --from-metrics).
READ_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:cache_config_info",
)
SAMPLE = re.compile(r"^(vllm:[A-Za-z0-9_:]+)(?:\{([^}]*)\})? (\S+)", re.MULTILINE)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="([^"]*)"')


@dataclass(frozen=True)
class Step:
    """One request of the trace; `subject` is what a cache may hold for it (a prefix or a
    chat session)."""

    label: str
    subject: str
    body: dict[str, Any]
    kind: str  # prewarm, query or chat

    @property
    def chat(self) -> bool:
        return self.kind == "chat"


def build_trace(key: str = "fidelity") -> list[Step]:
    """Registered prefixes A-D (prewarm, then queries) and chat sessions S1, S2; D's prewarm
    needs more room than is free, so the least recently used blocks go (B's, then S1's)."""
    prefixes = {name: document(f"{key}-{name}", PREFIX_WORDS) for name in "ABCD"}
    system = document(f"{key}-system", SYSTEM_WORDS)
    asked = [0]

    def prewarm(name: str) -> Step:
        return Step(f"prewarm {name}", name, {"prompt": prefixes[name], "max_tokens": 1}, "prewarm")

    def query(name: str) -> Step:
        asked[0] += 1
        text = f"{prefixes[name]}\nQuestion {asked[0]}: may a coupon stack with a discount?"
        return Step(f"query {name}", name, {"prompt": text, "max_tokens": 1}, "query")

    def turn(session: str, number: int) -> Step:
        messages = [{"role": "system", "content": f"{session}. {system}"}]
        for earlier in range(1, number + 1):
            messages.append({"role": "user", "content": f"Turn {earlier}: which clause applies?"})
            if earlier < number:  # the answer as the log has it, the same for both pods
                messages.append({"role": "assistant", "content": f"Clause {earlier} applies."})
        body = {"messages": messages, "max_tokens": 1}
        return Step(f"chat {session} turn {number}", session, body, "chat")

    return [
        prewarm("A"), query("A"), prewarm("B"), query("B"), turn("S1", 1), turn("S1", 2),
        prewarm("C"), query("C"), query("A"), turn("S2", 1), turn("S2", 2),
        prewarm("D"), query("D"), query("B"), turn("S1", 3), query("C"), query("A"), query("D"),
    ]  # fmt: skip


@dataclass(frozen=True)
class Reply:
    """One pod's answer to one step, beside what a cache that never evicts would give."""

    prompt_tokens: int
    cached: int
    ideal: int  # whole blocks shared with an earlier prompt, less the recomputed last token

    @property
    def outcome(self) -> str:
        if self.ideal == 0:
            return "cold" if self.cached == 0 else "extra"
        if self.cached >= self.ideal:
            return "full"
        return "partial" if self.cached else "none"


async def _tokens(session: aiohttp.ClientSession, url: str, model: str, step: Step) -> list[int]:
    key = "messages" if step.chat else "prompt"
    body = {"model": model, key: step.body[key]}
    async with session.post(f"{url}/tokenize", json=body) as resp:
        resp.raise_for_status()
        return list((await resp.json())["tokens"])


async def replay(
    session: aiohttp.ClientSession, url: str, model: str, trace: Sequence[Step], block: int
) -> list[Reply]:
    """Every step, in order and one at a time, non-streamed and greedy."""
    seen: list[list[int]] = []
    replies = []
    for step in trace:
        tokens = await _tokens(session, url, model, step)
        shared = max((common_length(tokens, earlier) for earlier in seen), default=0)
        seen.append(tokens)
        path = "/v1/chat/completions" if step.chat else "/v1/completions"
        body = {**step.body, "model": model, "temperature": 0.0}
        async with session.post(url + path, json=body) as resp:
            resp.raise_for_status()
            usage = (await resp.json())["usage"]
        ideal = whole_blocks(min(shared, len(tokens) - 1), block)
        replies.append(Reply(usage["prompt_tokens"], cached_tokens(usage), ideal))
    return replies


def samples(text: str) -> dict[str, list[dict[str, str]]]:
    """name -> the label sets of its samples, for the metrics the sidecar reads."""
    found: dict[str, list[dict[str, str]]] = {}
    for name, labels, _ in SAMPLE.findall(text):
        if name in READ_METRICS:
            found.setdefault(name, []).append(dict(_LABEL.findall(labels or "")))
    return found


def value_of(text: str, name: str) -> float:
    return sum(float(value) for found, _, value in SAMPLE.findall(text) if found == name)


@dataclass
class PodView:
    """What one pod said over the whole replay."""

    replies: list[Reply]
    metrics_before: str
    metrics_after: str
    headers: dict[str, str | None]  # "text", "json", "stream" -> the load header
    tokenize_keys: list[str]
    answer: dict[str, Any]  # a non-streamed completion, as the pod sent it
    stream_tail: str  # the last events of a stream with include_usage, in outline


async def observe(
    session: aiohttp.ClientSession, url: str, model: str, trace: Sequence[Step], block: int
) -> PodView:
    async with session.get(f"{url}/metrics") as resp:
        before = await resp.text()
    replies = await replay(session, url, model, trace, block)
    async with session.get(f"{url}/metrics") as resp:
        after = await resp.text()
    headers: dict[str, str | None] = {}
    body = {"model": model, "prompt": "May coupons stack?", "max_tokens": 2}
    answer: dict[str, Any] = {}
    tail = ""
    for kind, stream in (("text", False), ("json", False), ("stream", True)):
        asked = {FORMAT_HEADER: "json" if kind == "json" else "text"}
        options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        async with session.post(
            f"{url}/v1/completions", json={**body, **options}, headers=asked
        ) as resp:
            raw = await resp.read()
            headers[kind] = resp.headers.get(LOAD_HEADER)
        if stream:
            tail = _stream_tail(raw)
        else:
            answer = json.loads(raw)
    async with session.post(f"{url}/tokenize", json={"model": model, "prompt": "x y"}) as resp:
        keys = sorted(await resp.json())
    return PodView(replies, before, after, headers, keys, answer, tail)


def _stream_tail(raw: bytes) -> str:
    """The last two SSE events in outline: the usage event (its choices and whether its usage
    has cached_tokens), then the end marker."""
    events = [line[len(b"data: ") :] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    if len(events) < 2 or events[-1] != b"[DONE]":
        return f"no [DONE] after {len(events)} events"
    last = json.loads(events[-2])
    details = (last.get("usage") or {}).get("prompt_tokens_details") or {}
    return f"choices={last.get('choices')} cached_tokens={'cached_tokens' in details}, [DONE]"
