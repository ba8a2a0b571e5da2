"""The official openai SDK through the sidecar's HTTP front (`--openai-listen`) to real vLLM
pods: completions and chat, streamed and not. The answers are vLLM's, relayed verbatim, so
the usage the SDK parses is the pod's own: the prompt's token count matches the pod's
/tokenize, and the same prompt sent again is served with its whole blocks from the cache of
the pod that served it first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest_asyncio

from prefix_sidecar.upstream.byte_relay import BACKEND_HEADER
from prefix_sidecar_tools.vllm.fleet import VllmFleet
from prefix_sidecar_tools.vllm.reports import cache_counters, tokenize, whole_blocks
from prefix_sidecar_tools.vllm.tiny_model import document
from tests.vllm.conftest import VLLM_TESTS, serving_sidecar

pytestmark = VLLM_TESTS

MAX_TOKENS = 4


@pytest_asyncio.fixture(loop_scope="package")
async def client(fleet: VllmFleet, tmp_path: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    async with serving_sidecar(fleet, tmp_path) as (_, base):
        sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
        async with sdk:
            yield sdk


def cached_of(usage: openai.types.CompletionUsage | None) -> int:
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0


async def test_completions_streamed_and_not_report_vllms_usage(
    fleet: VllmFleet, session: aiohttp.ClientSession, client: openai.AsyncOpenAI
) -> None:
    prompt = document("http-completion", 1500)
    prompt_tokens = len(await tokenize(session, fleet.urls[0], fleet.model, prompt))
    block = (await cache_counters(session, fleet.urls[0])).block_size
    again = whole_blocks(prompt_tokens - 1, block)  # a hit always leaves one token to compute

    (model,) = [m.id async for m in client.models.list()]
    assert model == fleet.model
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
    )
    pod = raw.headers[BACKEND_HEADER]
    first = raw.parse()
    assert pod in fleet.urls
    assert first.model == fleet.model and first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.prompt_tokens == prompt_tokens
    assert first.usage.completion_tokens == MAX_TOKENS
    assert cached_of(first.usage) == 0

    before = await cache_counters(session, pod)
    chunks = await streamed(client.completions.create, model=model, prompt=prompt)
    after = await cache_counters(session, pod)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == first.choices[0].text  # greedy: the same tokens, streamed
    assert not chunks[-1].choices  # vLLM's usage chunk, last
    assert cached_of(chunks[-1].usage) == again
    assert after.hits - before.hits == again  # on the pod that served the first


async def test_chat_streamed_and_not_report_vllms_usage(
    fleet: VllmFleet, session: aiohttp.ClientSession, client: openai.AsyncOpenAI
) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "system", "content": document("http-chat", 1500)},
        {"role": "user", "content": "Which clause applies to a coupon order?"},
    ]
    block = (await cache_counters(session, fleet.urls[0])).block_size
    first = await client.chat.completions.create(
        model=fleet.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content and first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.prompt_tokens > 1500
    assert cached_of(first.usage) == 0

    chunks = await streamed(client.chat.completions.create, model=fleet.model, messages=messages)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == first.usage.prompt_tokens
    assert cached_of(chunks[-1].usage) == whole_blocks(first.usage.prompt_tokens - 1, block)


async def streamed(create: Any, **request: Any) -> list[Any]:
    """The chunks of the SDK's `create(**request)`, greedy and streamed with vLLM's usage
    chunk last."""
    stream = await create(
        **request,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    return [chunk async for chunk in stream]
