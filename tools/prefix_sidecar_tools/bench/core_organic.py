"""`bench core`'s organic section: the decision time of an unregistered 32 KB prompt.

The whole decision (`Router.for_prompt`: UTF-8 of the head, chained block keys, learning,
the anchor, the family share, `session_home`, the bounded-load pick, the failover list) on
a router whose anchor table has already learnt a mixed traffic of tenants and sessions,
100 pods, every prompt different, each call timed on its own so the p99 is a real p99.
The v1 window route (`unregistered_routing: window`) is timed in the same run as the
baseline. Target (issue 14): p99 <= 50 us. Also timed: a flow's first question, and a 32 KB
chat's later turn (`Router.for_chat`) whose previous turn the same router sent, so it
takes session follow's path (contract 9h), and the same chats as raw ChatML prompts.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from prefix_sidecar.config import build_config
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.membership.sources import Member
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.routing.router import Router
from prefix_sidecar_tools.emulator.protocol import render_chat
from prefix_sidecar_tools.percentile import percentile

PROMPT_BYTES = 32 * 1024
PODS = 100
TARGET_P99_US = 50.0
WORDS = ("coupon", "voucher", "stacking", "refund", "parcel", "jacket", "discount", "banned")


def _prose(rng: random.Random, size: int) -> str:
    text = ""
    while len(text) < size:
        text += " ".join(rng.choice(WORDS) for _ in range(12)) + ". "
    return text[:size]


def _prompts(rng: random.Random, systems: list[str], count: int) -> list[str]:
    """Chat-shaped raw prompts of exactly PROMPT_BYTES: a tenant's system prompt, then a
    session's history (its first user message first)."""
    prompts = []
    for _ in range(count):
        system = rng.choice(systems)
        history = f"<|im_start|>user\nTurn 0: {_prose(rng, 200)}<|im_end|>\n"
        body = system + history + _prose(rng, PROMPT_BYTES)
        prompts.append(body[:PROMPT_BYTES])
    return prompts


def _starts(rng: random.Random, systems: list[str], count: int) -> list[str]:
    """First questions (a system prompt and a short user message): requests that start a
    flow, which also look up the family's home set and the pods' counts (contract 9f)."""
    return [
        rng.choice(systems) + f"<|im_start|>user\nQuestion: {_prose(rng, 200)}<|im_end|>\n"
        for _ in range(count)
    ]


Chat = list[tuple[str, str]]


def _chats(rng: random.Random, systems: list[str], count: int) -> list[tuple[Chat, Chat]]:
    """32 KB conversations, each with the request before it (one exchange fewer): a
    system message, then turns of a 150-byte question and a 400-byte answer."""
    pairs = []
    for _ in range(count):
        messages: Chat = [("system", rng.choice(systems))]
        size = len(messages[0][1])
        while size < PROMPT_BYTES:
            for role, length in (("user", 150), ("assistant", 400)):
                messages.append((role, _prose(rng, length)))
                size += length
        messages.append(("user", _prose(rng, 150)))
        pairs.append((messages[:-2], messages))
    return pairs


def _router(pods: list[str], routing: str) -> Router:
    pool = BackendPool(warm_before_serve=False)
    pool.set_members([Member(url, 1) for url in pods])
    for url in pods:
        pool.set_health(url, True)
    return Router.from_config(pool, PrefixStore(), build_config({"unregistered_routing": routing}))


def _timed_us(
    decide: Callable[[Any], object],
    inputs: Sequence[Any],
    before: Callable[[Any], object] | None = None,
) -> list[float]:
    """Each `decide(input)` timed alone (after `before(input)`, untimed), collections off:
    a pause would land in one call's time."""
    times = []
    clock = time.perf_counter_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for item in inputs:
            if before is not None:
                before(item)
            start = clock()
            decide(item)
            times.append((clock() - start) / 1e3)
    finally:
        if gc_was_enabled:
            gc.enable()
    return times


def _followed_us(router: Router, pairs: list[tuple[Chat, Chat]]) -> list[float]:
    """Each chat's decision, timed after its previous request went through the router."""
    return _timed_us(
        lambda pair: router.for_chat(pair[1]), pairs, before=lambda pair: router.for_chat(pair[0])
    )


def _followed_raw_us(router: Router, pairs: list[tuple[Chat, Chat]]) -> list[float]:
    """The same conversations rendered in ChatML and sent as raw prompts: followed by their
    template's last two assistant headers (9h), read at the prompt's end."""
    rendered = [(_chatml(before), _chatml(after)) for before, after in pairs]
    return _timed_us(
        lambda pair: router.for_prompt(pair[1]), rendered, before=lambda p: router.for_prompt(p[0])
    )


def _chatml(chat: Chat) -> str:
    return render_chat([{"role": role, "content": content} for role, content in chat])


def _spread(times: list[float]) -> dict[str, float]:
    return {"p50_us": percentile(times, 50), "p99_us": percentile(times, 99), "max_us": max(times)}


def organic_decisions(quick: bool, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    pods = [f"http://10.1.{i // 250}.{i % 250 + 2}:8000" for i in range(PODS)]
    systems = [
        f"<|im_start|>system\nYou are the assistant of store #{t}. "
        + _prose(rng, rng.randint(300, 3000))
        + "<|im_end|>\n"
        for t in range(32)
    ]
    warm = _prompts(rng, systems, 300 if quick else 2000)
    measured = _prompts(rng, systems, 1000 if quick else 3000)  # a p99 of 10+ tail values
    result: dict[str, Any] = {"prompt_bytes": PROMPT_BYTES, "pods": PODS, "calls": len(measured)}
    for routing in ("organic", "window"):
        router = _router(pods, routing)
        for prompt in warm:  # learn the tenants' anchors and shares first
            router.for_prompt(prompt)
        result[routing] = _spread(_timed_us(router.for_prompt, measured))
        if routing == "organic":
            starts = _starts(rng, systems, len(measured))
            result["organic_start"] = _spread(_timed_us(router.for_prompt, starts))
            # a chat's next turn, whose previous one went through this router: followed
            chats = _chats(rng, systems, len(measured))
            result["organic_chat"] = _spread(_followed_us(router, chats))
            result["organic_raw_followed"] = _spread(_followed_raw_us(router, chats))
            assert router.organic is not None
            result["anchor_table_entries"] = len(router.organic.table)
            result["anchor_table_bound"] = router.organic.table.max_entries
    p99 = result["organic"]["p99_us"]
    result["target"] = {
        "name": f"organic decision of a {PROMPT_BYTES // 1024} KB prompt: p99 <= "
        f"{TARGET_P99_US:g} us",
        "measured": f"{p99:.1f} us",
        "met": p99 <= TARGET_P99_US,
    }
    return result


def render_organic(organic: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"organic routing: one decision of an unregistered {organic['prompt_bytes'] // 1024} KB "
        f"prompt, {organic['pods']} pods, {organic['calls']} prompts each timed alone, us",
        f"  {'routing':<22}{'p50':>9}{'p99':>9}{'max':>9}",
    ]
    for routing in ("organic", "organic_start", "organic_chat", "organic_raw_followed", "window"):
        times = organic.get(routing)
        if times is None:
            continue
        lines.append(
            f"  {routing:<22}{times['p50_us']:>9.1f}{times['p99_us']:>9.1f}{times['max_us']:>9.1f}"
        )
    lines.append("  (organic_start: a first question, under 512 bytes past its system prompt;")
    if "organic_chat" in organic:
        lines.append(
            "   organic_chat: a 32 KB chat's next turn, Router.for_chat, its previous turn sent "
            "by the same router: session follow recalls it;\n"
            "   organic_raw_followed: the same chats rendered in ChatML, Router.for_prompt: "
            "their template's last two assistant headers read, then recalled)"
        )
    lines.append(
        f"  anchor table: {organic['anchor_table_entries']:,} entries (bound "
        f"{organic['anchor_table_bound']:,})"
    )
    target = organic["target"]
    lines.append(
        f"  {target['name']}: {target['measured']} - {'MET' if target['met'] else 'NOT MET'}"
    )
    return lines
