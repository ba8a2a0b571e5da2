"""tokenizer_file: precise routing tokenizes raw prompts with the pods' tokenizer once a pod
has confirmed its ids, asks a pod for every chat, and stops using a file that disagrees.
The pod here is a real HTTP server on 127.0.0.1 answering /tokenize with a tokenizer built
in the test (the real-vLLM check is tests/vllm/test_local_tokenizer.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from prefix_sidecar.config import ConfigError, build_config
from prefix_sidecar.kv_events import precise
from prefix_sidecar.kv_events.fleet_blocks import FleetBlocks
from prefix_sidecar.kv_events.precise import PreciseRouting
from prefix_sidecar.routing.decision import Decision
from prefix_sidecar.routing.pick import Branch
from prefix_sidecar.upstream import local_tokenizer
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.local_tokenizer import CHECKS, INLINE_BYTES, LocalTokenizer
from prefix_sidecar.upstream.tokenize import TokenizeError
from tests.fake_pod import start_site

CORPUS = ["refunds within seven days", "no coupon stacking on sale items", "ship in 48 hours"]


def built(path: Path, vocab: int = 400) -> Path:
    """A small BPE tokenizer trained on CORPUS, saved as a tokenizer.json."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    tokenizer.save(str(path))
    return path


class Pod:
    """A /tokenize answered by `tokenizer` (a chat: its messages' contents joined), counted."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.asked: list[str] = []

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "prompt" in body:
            text = body["prompt"]
            self.asked.append("prompt")
        else:
            text = "\n".join(m["content"] for m in body["messages"])
            self.asked.append("chat")
        ids = self.tokenizer.encode(text).ids
        return web.json_response({"count": len(ids), "tokens": ids, "max_model_len": 4096})


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    return built(tmp_path / "tokenizer.json")


async def routing_before(pod: Pod) -> AsyncIterator[tuple[PreciseRouting, Decision]]:
    app = web.Application()
    app.router.add_post("/tokenize", pod.tokenize)
    runner, url = await start_site(app)
    try:
        async with UpstreamClient() as client:
            routing = PreciseRouting(client, FleetBlocks(), cast(Any, None))
            yield routing, Decision(url, [url], None, 0, Branch.HOME, 0, 0)
    finally:
        await runner.cleanup()


async def test_prompts_are_tokenized_here_once_a_pod_confirmed_and_chats_always_ask(
    tokenizer_file: Path,
) -> None:
    pod = Pod(Tokenizer.from_file(str(tokenizer_file)))
    async for routing, decision in routing_before(pod):
        routing.local = LocalTokenizer.load(str(tokenizer_file))
        prompts = [f"refunds within {n} days, no coupon stacking" for n in range(CHECKS + 3)]
        for prompt in prompts:
            ids = await routing.tokens(decision, {"prompt": prompt}, "m")
            assert ids == pod.tokenizer.encode(prompt).ids
        assert pod.asked == ["prompt"] * CHECKS  # the later prompts asked no pod
        assert routing.local.trusted

        chat = {"messages": [{"role": "user", "content": "ship in 48 hours?"}]}
        await routing.tokens(decision, chat, "m")
        assert pod.asked[-1] == "chat"


async def test_a_file_that_disagrees_with_the_pods_is_dropped(
    tokenizer_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = Tokenizer.from_file(str(built(tmp_path / "other.json", vocab=280)))
    pod = Pod(other)
    async for routing, decision in routing_before(pod):
        routing.local = LocalTokenizer.load(str(tokenizer_file))
        with caplog.at_level(logging.WARNING):
            for n in range(CHECKS + 2):
                prompt = f"no coupon stacking on sale items {n}"
                assert await routing.tokens(decision, {"prompt": prompt}, "m") == (
                    other.encode(prompt).ids
                )
        assert pod.asked == ["prompt"] * (CHECKS + 2)  # every prompt: the pods' ids
        assert not routing.local.usable
        assert "does not give the pods' token ids" in caplog.text


async def test_a_long_prompt_is_encoded_off_the_event_loop_to_the_same_ids(
    tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threaded: list[int] = []
    to_thread = asyncio.to_thread

    async def recorded(call: Any, *args: Any) -> Any:
        threaded.append(len(args[0][0]))
        return await to_thread(call, *args)

    monkeypatch.setattr(local_tokenizer.asyncio, "to_thread", recorded)
    local, reference = (
        LocalTokenizer.load(str(tokenizer_file)),
        Tokenizer.from_file(str(tokenizer_file)),
    )
    long = "refunds within seven days; " * (INLINE_BYTES // 10)
    assert await local.ids(long) == reference.encode(long).ids
    assert await local.ids("ship in 48 hours") == reference.encode("ship in 48 hours").ids
    wide = "退款七天内。" * (INLINE_BYTES // 15)  # fewer characters than bytes allow inline
    assert len(wide) < INLINE_BYTES < len(wide.encode())
    assert await local.ids(wide) == reference.encode(wide).ids
    assert threaded == [len(long), len(wide)]  # by bytes, not characters


async def test_an_encode_past_the_bound_keeps_the_organic_decision(
    tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encode slower than TOKENIZE_TIMEOUT_S (a huge prompt) is a TokenizeError, which
    refine answers with the organic decision, as a pod that did not answer in time."""
    monkeypatch.setattr(precise, "TOKENIZE_TIMEOUT_S", 0.05)

    class Slow(LocalTokenizer):
        async def ids(self, prompt: str) -> list[int]:
            await asyncio.sleep(5)
            return []

    pod = Pod(Tokenizer.from_file(str(tokenizer_file)))
    async for routing, decision in routing_before(pod):
        routing.local = Slow(Tokenizer.from_file(str(tokenizer_file)), "slow")
        with pytest.raises(TokenizeError, match="no ids within"):
            await routing.tokens(decision, {"prompt": "ship in 48 hours"}, "m")
        assert pod.asked == []


PRECISE = {"unregistered_routing": "precise", "kv_events": True, "backends": ["http://a:1"]}


def test_the_config_names_what_to_fix(tokenizer_file: Path, tmp_path: Path) -> None:
    assert build_config(overrides={**PRECISE, "tokenizer_file": str(tokenizer_file)})
    with pytest.raises(ConfigError, match="precise routing only"):
        build_config(overrides={"backends": ["http://a:1"], "tokenizer_file": str(tokenizer_file)})
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(overrides={**PRECISE, "tokenizer_file": str(tmp_path / "none.json")})
    not_json = tmp_path / "weights.bin"
    not_json.write_bytes(b"\x00\x01")
    with pytest.raises(ConfigError, match=r"is not a tokenizer\.json"):
        LocalTokenizer.load(str(not_json))


def test_without_the_package_the_error_names_the_extra(
    tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tokenizers" else real(name)
    )
    with pytest.raises(ConfigError, match=r"prefix-sidecar\[tokenizer\]"):
        build_config(overrides={**PRECISE, "tokenizer_file": str(tokenizer_file)})
