"""bench organic's `sglang` / `sglang_xK` runs: SGLang's own router (PyPI `sglang-router`,
`--policy cache_aware`) as its users run it, a process of its own in front of the emulated
pods, every request an OpenAI POST to it. The in-process radix baseline (organic_radix)
decides with the same algorithm but pays no hop; this one pays the hop a sidecar pays.

Its tree is sized and evicted as the radix baseline's (`--max-tree-size`, 4 x --kv-tokens
characters by default; `--eviction-interval-secs 1`, its default is 120): left at its
defaults it would remember every prompt of a run as cached while the pods evict. K runs
(sglang_xK) are K routers, each with its own tree, each request to one drawn at random.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from prefix_sidecar_tools.bench.organic_driver import Sender, http_front_sender
from prefix_sidecar_tools.vllm.sglang import SglangRouter, sglang_router_available


def sglang_args(tree_chars: int, eviction_interval_s: float) -> list[str]:
    """The radix baseline's tree size and eviction interval (whole seconds, at least 1: the
    router takes an integer)."""
    return [
        "--max-tree-size", str(tree_chars),
        "--eviction-interval-secs", str(max(round(eviction_interval_s), 1)),
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def sglang_senders(
    session: aiohttp.ClientSession,
    urls: list[str],
    replicas: int,
    tree_chars: int,
    eviction_interval_s: float,
    model: str,
    **send: Any,
) -> AsyncIterator[Sender]:
    """`replicas` SGLang routers over the pods at `urls`; the sender posts to them.
    `send`: http_front_sender's chat, max_tokens, first_token_timeout_s and pin_flows."""
    if not sglang_router_available():
        raise RuntimeError(
            "bench organic's sglang runs need SGLang's router: pip install sglang-router"
        )
    async with contextlib.AsyncExitStack() as stack:
        routers = [
            await stack.enter_async_context(
                SglangRouter(
                    urls,
                    policy="cache_aware",
                    extra_args=sglang_args(tree_chars, eviction_interval_s),
                )
            )
            for _ in range(replicas)
        ]
        yield http_front_sender(session, [r.url for r in routers], model=model, **send)
