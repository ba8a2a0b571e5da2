"""Prefix sizes from a pod's own tokenizer: vLLM's and llama.cpp's /tokenize shapes, against
real aiohttp servers on 127.0.0.1 (the emulator is vLLM's shape), hostile answers, and the
once-per-prefix sizer feeding the store (hence the placement)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from prefix_sidecar.prefixes import PrefixError, PrefixStore
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.tokenize import PrefixSizer, TokenizeError, count_tokens, read_count
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator
from prefix_sidecar_tools.emulator.tokenizer import count_tokens as emulator_count
from tests.fake_pod import start_site


class Tokenizer:
    """A pod with llama.cpp's /tokenize (or a hostile one): 1 token per 3 bytes."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answer: Any = None  # overrides the honest answer
        self.status = 200

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.Response(status=self.status)
        if self.answer is not None:
            return web.Response(text=self.answer if isinstance(self.answer, str) else "")
        content = body.get("content", "")  # llama.cpp: no 'content', no tokens
        return web.json_response({"tokens": list(range(len(content.encode()) // 3))})


@pytest.fixture
async def llama() -> AsyncIterator[tuple[str, Tokenizer]]:
    pod = Tokenizer()
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/tokenize", pod.handle)
    app.router.add_post("/moved", _redirect)
    runner, base_url = await start_site(app)
    yield base_url, pod
    await runner.cleanup()


async def _redirect(request: web.Request) -> web.Response:
    raise web.HTTPFound("/tokenize")


async def test_vllm_shape_against_the_emulator() -> None:
    text = "rules " * 2000
    async with run_emulator(EmulatorConfig()) as url, UpstreamClient() as client:
        assert await count_tokens(client, url, text) == emulator_count(text.encode())
        assert await count_tokens(client, url, text, model="m") == emulator_count(text.encode())


async def test_llama_cpp_shape_after_an_empty_vllm_shaped_answer(
    llama: tuple[str, Tokenizer],
) -> None:
    url, pod = llama
    async with UpstreamClient() as client:
        assert await count_tokens(client, url, "x" * 3000) == 1000
    assert [sorted(b) for b in pod.bodies] == [["prompt"], ["content"]]


@pytest.mark.parametrize(
    "answer",
    [
        "not json",
        "[1, 2]",
        '{"count": "12"}',
        '{"count": true}',
        '{"count": 0}',
        '{"count": 999999}',  # more tokens than bytes: not believable
        '{"tokens": "abc"}',
        "[" * 100_000,
    ],
)
async def test_hostile_answers_are_refused(llama: tuple[str, Tokenizer], answer: str) -> None:
    url, pod = llama
    pod.answer = answer
    async with UpstreamClient() as client:
        with pytest.raises(TokenizeError):
            await count_tokens(client, url, "hello world")


async def test_oversized_answer_redirect_and_errors_are_refused(
    llama: tuple[str, Tokenizer],
) -> None:
    url, pod = llama
    async with UpstreamClient() as client:
        pod.answer = json.dumps({"tokens": [1] * 100_000})  # 300 KB for an 11-byte text
        with pytest.raises(TokenizeError, match="over"):
            await count_tokens(client, url, "hello world")
        pod.answer = None
        with pytest.raises(TokenizeError, match="HTTP 302"):
            await count_tokens(client, url, "hello world", path="/moved")
        pod.status = 404
        with pytest.raises(TokenizeError, match="HTTP 404"):
            await count_tokens(client, url, "hello world")


def test_read_count_prefers_vllms_count() -> None:
    assert read_count({"count": 3, "tokens": [1, 2, 3], "max_model_len": 10}, 10) == 3
    assert read_count({"tokens": [1, 2]}, 10) == 2
    with pytest.raises(TokenizeError):
        read_count({"count": 75}, 10)  # 10 bytes + 64 special tokens at most


async def test_sizer_counts_each_prefix_once_and_feeds_the_store(
    llama: tuple[str, Tokenizer],
) -> None:
    url, pod = llama
    store = PrefixStore(16, 1 << 20)
    changes: list[int] = []
    store.watch(lambda: changes.append(store.generation))
    entry, _ = store.register("rules", "r" * 3000)
    store.register("other", "o" * 300)
    async with UpstreamClient() as client:
        pods: list[str] = []
        sizer = PrefixSizer(store, client, lambda: pods)
        await sizer.run_pass()
        assert entry.tokens == 0 and pod.bodies == []  # no pod yet: bytes for now
        pods.append(url)
        await sizer.run_pass()
        assert entry.tokens == 1000 and store.get(entry.id).tokens == 1000
        asked = len(pod.bodies)
        await sizer.run_pass()
        assert len(pod.bodies) == asked  # once per prefix
    assert len(changes) == 4  # two registrations, two counts


async def test_sizer_gives_up_after_a_few_failures(llama: tuple[str, Tokenizer]) -> None:
    url, pod = llama
    pod.status = 404
    store = PrefixStore(16, 1 << 20)
    entry, _ = store.register("rules", "r" * 300)
    async with UpstreamClient() as client:
        sizer = PrefixSizer(store, client, lambda: [url])
        for _ in range(5):
            await sizer.run_pass()
    assert entry.tokens == 0 and len(pod.bodies) == 2 * 3  # two shapes x three tries


def test_set_tokens_checks_its_input() -> None:
    store = PrefixStore(4, 1024)
    entry, _ = store.register("a", "text")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(PrefixError):
            store.set_tokens(entry.id, bad)  # type: ignore[arg-type]
    assert store.set_tokens(entry.id, 2) and not store.set_tokens(entry.id, 2)
    assert not store.set_tokens("missing", 2)
