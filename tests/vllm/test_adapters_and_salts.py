"""What real vLLM does with LoRA adapters and cache salts, the facts the sidecar's routing by
adapter and salt relies on (issue 30), asked of one pod of the tiny model with LoRA: the
adapter `lora-a` loaded at start, loading at run time allowed, KV events on.

- an adapter's prefix cache is apart from the base model's (both ways) and from another
  adapter's, one loaded at run time included; an unloaded adapter is vLLM's 404;
- two salts share nothing, an unsalted prompt shares nothing with a salted one, and each
  salt's repeats hit, on /v1/completions and /v1/chat/completions; an empty salt is a 400;
- the KV events name the adapter (`lora_name`, `extra_keys` on every block) and the salt
  (`extra_keys` of the prompt's first block).

One pod (the package's shared fleet is not used: it has no LoRA), started once for the
module; `python -m prefix_sidecar_tools.vllm.lora_facts` prints the same facts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from prefix_sidecar_tools.vllm import lora
from prefix_sidecar_tools.vllm.fleet import (
    VllmFleet,
    ensure_adapter,
    ensure_tiny_model,
    vllm_python,
)
from prefix_sidecar_tools.vllm.reports import cached_tokens
from prefix_sidecar_tools.vllm.tiny_model import document
from tests.vllm.conftest import VLLM_TESTS, processes_within

pytestmark = VLLM_TESTS

ADAPTER = "lora-a"
WORDS = 1500  # ~1,850 tokens: 14 whole blocks of 128
WHOLE = 1024  # a hit serves at least this many (8 blocks): the tests read "hit" as >= this


@pytest_asyncio.fixture(scope="module", loop_scope="package")
async def lora_pod() -> AsyncIterator[VllmFleet]:
    python = vllm_python()
    assert python is not None
    model = ensure_tiny_model(python)
    adapter = ensure_adapter(python, model, ADAPTER)
    fleet = VllmFleet(
        model,
        1,
        python=python,
        lora_modules={ADAPTER: adapter},
        runtime_lora=True,
        kv_events=True,
    )
    async with fleet:
        yield fleet
    assert not processes_within(fleet.scratch), "vLLM processes outlived the pod"


async def send(
    session: aiohttp.ClientSession,
    pod: VllmFleet,
    prompt: str,
    model: str | None = None,
    chat: bool = False,
    **extra: Any,
) -> tuple[int, Any]:
    """One greedy request of one token: (status, the answer's JSON)."""
    body: dict[str, Any] = {"model": model or pod.model, "max_tokens": 1, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(pod.urls[0] + path, json={**body, **extra}) as response:
        return response.status, await response.json()


async def cached(
    session: aiohttp.ClientSession, pod: VllmFleet, prompt: str, model: str | None = None, **kw: Any
) -> int:
    status, answer = await send(session, pod, prompt, model, **kw)
    assert status == 200, answer
    return cached_tokens(answer["usage"])


def hits(seen: list[int]) -> list[bool]:
    return [tokens >= WHOLE for tokens in seen]


def not_found(model: str, base: str) -> dict[str, Any]:
    message = f"The model `{model}` does not exist. Valid aliases: {base}."
    return {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}}


async def test_models_lists_the_adapter_beside_the_base_model(
    lora_pod: VllmFleet, session: aiohttp.ClientSession
) -> None:
    cards = await lora.served_models(session, lora_pod.urls[0])
    shown = [(c["id"], c["parent"], c["max_model_len"]) for c in cards]
    assert shown == [
        (lora_pod.model, None, lora_pod.max_model_len),
        (ADAPTER, lora_pod.model, None),
    ]
    assert cards[1]["root"] == str(lora_pod.lora_modules[ADAPTER])
    assert all(card["permission"][0]["object"] == "model_permission" for card in cards)


async def test_an_adapters_cache_is_apart_from_the_base_models(
    lora_pod: VllmFleet, session: aiohttp.ClientSession
) -> None:
    base, first = document("adapters-base-first", WORDS), document("adapters-lora-first", WORDS)
    base_first = [await cached(session, lora_pod, base, m) for m in [None, None, ADAPTER, ADAPTER]]
    lora_first = [await cached(session, lora_pod, first, m) for m in [ADAPTER, None, None]]
    print(f"\nbase, base, adapter, adapter: {base_first}\nadapter, base, base: {lora_first}")
    assert hits(base_first) == [False, True, False, True]
    assert hits(lora_first) == [False, False, True]
    assert base_first[0] == lora_first[1] == 0


async def test_an_adapter_loaded_at_run_time_has_its_own_cache_until_unloaded(
    lora_pod: VllmFleet, session: aiohttp.ClientSession
) -> None:
    python = vllm_python()
    assert python is not None
    adapter_b = ensure_adapter(python, lora_pod.model_dir, "lora-b")
    prompt = document("adapters-runtime", WORDS)
    warm = [await cached(session, lora_pod, prompt, m) for m in [None, ADAPTER]]
    assert await lora_pod.load_adapter(0, "lora-b", adapter_b) == (
        200,
        "Success: LoRA adapter 'lora-b' added successfully.",
    )
    loaded = [await cached(session, lora_pod, prompt, "lora-b") for _ in range(2)]
    print(f"\nbase, lora-a: {warm}; lora-b twice: {loaded}")
    assert hits(loaded) == [False, True]
    assert await lora_pod.unload_adapter(0, "lora-b") == (
        200,
        "Success: LoRA adapter 'lora-b' removed successfully.",
    )
    status, answer = await send(session, lora_pod, prompt, "lora-b")
    assert (status, answer) == (404, not_found("lora-b", lora_pod.model))
    status, answer = await send(session, lora_pod, prompt, "nope")
    assert (status, answer) == (404, not_found("nope", lora_pod.model))


@pytest.mark.parametrize("chat", [False, True])
async def test_two_salts_share_nothing_and_each_salts_repeats_hit(
    lora_pod: VllmFleet, session: aiohttp.ClientSession, chat: bool
) -> None:
    prompt = document(f"salts-{chat}", WORDS)
    salts = ["tenant-a", "tenant-b", None, "tenant-a", "tenant-b", None]
    seen = []
    for salt in salts:
        extra = {"cache_salt": salt} if salt else {}
        seen.append(await cached(session, lora_pod, prompt, chat=chat, **extra))
    under_adapter = [
        await cached(session, lora_pod, prompt, ADAPTER, chat=chat, cache_salt="tenant-a")
        for _ in range(2)
    ]
    print(f"\n{list(zip(salts, seen, strict=True))}; tenant-a under the adapter: {under_adapter}")
    assert seen[:3] == [0, 0, 0], "no hit across salts, nor between salted and unsalted"
    assert hits(seen[3:]) == [True] * 3, "each salt's repeats hit"
    assert under_adapter[0] == 0 and hits(under_adapter) == [False, True]


async def test_an_empty_salt_is_refused(
    lora_pod: VllmFleet, session: aiohttp.ClientSession
) -> None:
    message = "Parameter 'cache_salt' must be a non-empty string if provided."
    error = {"message": f"{message} (parameter=cache_salt)", "type": "BadRequestError"}
    status, answer = await send(session, lora_pod, "hi", cache_salt="")
    assert (status, answer) == (400, {"error": {**error, "param": "cache_salt", "code": 400}})


async def replayed(endpoint: str, start: int) -> list[tuple[int, list[dict[str, Any]]]]:
    """The batches the pod holds from sequence number `start`, from its replay ROUTER."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    batches: list[tuple[int, list[dict[str, Any]]]] = []
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            _, _, seq, payload = await dealer.recv_multipart()
            if not payload:
                return batches
            events = msgpack.unpackb(payload, strict_map_key=False)[1]
            batches.append((int.from_bytes(seq, "big"), events))
    finally:
        context.destroy(linger=0)


async def test_kv_events_name_the_adapter_and_the_salt(
    lora_pod: VllmFleet, session: aiohttp.ClientSession
) -> None:
    replay = f"tcp://127.0.0.1:{lora_pod.kv_event_ports[lora_pod.pods[0].port][1]}"
    prompt = document("adapters-events", 300)  # ~370 tokens: two whole blocks
    sends = [(None, None), (ADAPTER, None), (None, "tenant-a"), (ADAPTER, "tenant-a")]
    stored = []
    for model, salt in sends:
        start = (await replayed(replay, 0) or [(-1, [])])[-1][0] + 1
        await cached(session, lora_pod, prompt, model, **({"cache_salt": salt} if salt else {}))
        for _ in range(100):
            events = [e for _, batch in await replayed(replay, start) for e in batch]
            new = [e for e in events if e.get("type") == "BlockStored"]
            if new:
                stored.append(new[0])
                break
            await asyncio.sleep(0.05)
    assert len(stored) == len(sends), "a request's blocks were never published"
    seen = [(e["lora_name"], e["extra_keys"][:2]) for e in stored]
    print(f"\n{seen}")
    assert seen == [
        (None, [None, None]),
        (ADAPTER, [[ADAPTER], [ADAPTER]]),
        (None, [["tenant-a"], None]),
        (ADAPTER, [[ADAPTER, "tenant-a"], [ADAPTER]]),
    ]
    assert [e["lora_id"] for e in stored] == [None, 1, None, 1]
    assert len({e["block_hashes"][0] for e in stored}) == 4  # four caches apart
