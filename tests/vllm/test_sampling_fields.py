"""Fields real vLLM honours and the emulator ignores (n, logprobs, stop, seed,
response_format with a JSON schema) come back as vLLM produced them: verbatim over the
HTTP front, and through extra_json and raw_events on gRPC. "As vLLM produced them" is
checked against the same request sent straight to the pod that served it: with a seed,
vLLM samples the same tokens again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai

from prefix_sidecar.upstream.byte_relay import BACKEND_HEADER
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.vllm.fleet import VllmFleet
from tests.vllm.conftest import VLLM_TESTS, serving_sidecar

pytestmark = VLLM_TESTS

PROMPT = "May a store coupon stack with a platform coupon"
SAMPLING: dict[str, Any] = {
    "max_tokens": 12,
    "temperature": 0.8,
    "seed": 7,
    "n": 2,
    "logprobs": 2,
    "stop": ["a"],
}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
}


def choices_of(answer: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(text, logprobs, finish_reason) per choice, in index order."""
    ordered = sorted(answer["choices"], key=lambda choice: choice["index"])
    return [(c["text"], c["logprobs"], c["finish_reason"]) for c in ordered]


async def straight_to(
    session: aiohttp.ClientSession, pod: str, model: str, **body: Any
) -> dict[str, Any]:
    async with session.post(f"{pod}/v1/completions", json={"model": model, **body}) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


async def test_sampling_fields_come_back_as_vllm_produced_them(
    fleet: VllmFleet, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    async with serving_sidecar(fleet, tmp_path) as (sidecar, base):
        async with session.post(
            f"{base}/v1/completions",
            json={"model": fleet.model, "prompt": PROMPT, **SAMPLING},
            headers={"authorization": "Bearer sk-test"},
        ) as resp:
            assert resp.status == 200, await resp.text()
            pod = resp.headers[BACKEND_HEADER]
            over_http = await resp.json()

        async with grpc.aio.insecure_channel(sidecar.target) as channel:
            call = router_pb2_grpc.RouterStub(channel).Complete(
                router_pb2.CompleteRequest(
                    prefix_text=PROMPT,
                    extra_json=json.dumps(SAMPLING),
                    raw_events=True,
                ),
                timeout=60,
            )
            chunks = [chunk async for chunk in call]

        sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
        async with sdk:
            structured = await sdk.chat.completions.create(
                model=fleet.model,
                messages=[{"role": "user", "content": "Is this order compliant?"}],
                max_tokens=40,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "verdict", "schema": SCHEMA},
                },
            )

    direct = await straight_to(session, pod, fleet.model, prompt=PROMPT, **SAMPLING)
    assert len(over_http["choices"]) == 2
    assert all(choice["logprobs"]["tokens"] for choice in over_http["choices"])
    assert choices_of(over_http) == choices_of(direct)

    # gRPC: the pod's streamed events, relayed unchanged; per choice, the same text
    events = [json.loads(e) for chunk in chunks for e in chunk.events]
    texts: dict[int, str] = {}
    for event in events:
        for choice in event.get("choices", []):
            assert choice["logprobs"] is not None or choice["text"] == ""
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert chunks[0].backend in fleet.urls
    assert [texts[i] for i in sorted(texts)] == [text for text, _, _ in choices_of(direct)]

    verdict = json.loads(structured.choices[0].message.content or "")
    assert isinstance(verdict["ok"], bool)
