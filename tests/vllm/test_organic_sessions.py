"""Organic routing against real vLLM pods: chats sent through the HTTP front with nothing
registered. A session's second turn goes to the pod that served its first, and vLLM serves
it from that pod's cache: its cached_tokens cover the first turn's whole blocks, less at
most one block where the assistant's answer joins the template.

Four sessions, each with its own system prompt, so a second turn that landed on the right
pod by chance on every session would happen once in sixteen runs on two pods; the cache
figures come from vLLM, the pod from the front's backend header.
"""

from __future__ import annotations

from pathlib import Path

import openai

from prefix_sidecar.upstream.byte_relay import BACKEND_HEADER
from prefix_sidecar_tools.vllm.fleet import VllmFleet
from prefix_sidecar_tools.vllm.reports import whole_blocks
from prefix_sidecar_tools.vllm.tiny_model import document
from tests.vllm.conftest import VLLM_TESTS, serving_sidecar

pytestmark = VLLM_TESTS

SESSIONS = 4


async def test_a_sessions_next_turn_is_a_cache_hit_on_the_pod_of_its_first(
    fleet: VllmFleet, tmp_path: Path
) -> None:
    async with serving_sidecar(fleet, tmp_path) as (_, base):
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
        async with client:
            turns = []
            for session in range(SESSIONS):
                messages: list[openai.types.chat.ChatCompletionMessageParam] = [
                    {"role": "system", "content": document(f"organic-{session}", 1200)},
                    {"role": "user", "content": f"Session {session}: may coupons stack?"},
                ]
                first = await client.chat.completions.with_raw_response.create(
                    model=fleet.model, messages=messages, max_tokens=8, temperature=0.0
                )
                answer = first.parse()
                messages.append(
                    {"role": "assistant", "content": answer.choices[0].message.content or ""}
                )
                messages.append({"role": "user", "content": "And on a live stream?"})
                second = await client.chat.completions.with_raw_response.create(
                    model=fleet.model, messages=messages, max_tokens=8, temperature=0.0
                )
                turns.append((first.headers[BACKEND_HEADER], answer, second))

    for session, (first_pod, answer, second) in enumerate(turns):
        reply = second.parse()
        assert answer.usage is not None and reply.usage is not None
        assert reply.usage.prompt_tokens_details is not None
        cached = reply.usage.prompt_tokens_details.cached_tokens or 0
        floor = whole_blocks(answer.usage.prompt_tokens, fleet.block_size)
        print(
            f"session {session}: first on {first_pod} ({answer.usage.prompt_tokens} tokens), "
            f"second on {second.headers[BACKEND_HEADER]}, cached {cached} (floor {floor})"
        )
        assert second.headers[BACKEND_HEADER] == first_pod
        assert floor - fleet.block_size <= cached <= reply.usage.prompt_tokens
