"""Precise organic routing (unregistered_routing: precise) before three emulated pods that
publish KV events: a prompt cached on a pod the organic decision would not pick goes to that
pod, on the gRPC Complete and Chat paths and the HTTP front, and a cold one keeps the organic
pick. The fleet's block map (fleet_blocks.py) is checked on its own too."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from prefix_sidecar.kv_events import expected, precise
from prefix_sidecar.kv_events.decode import BlockRemoved
from prefix_sidecar.kv_events.fleet_blocks import FleetBlocks
from prefix_sidecar.kv_events.precise import PreciseRouting
from prefix_sidecar.routing.decision import Decision
from prefix_sidecar.routing.pick import Branch
from prefix_sidecar.routing.scope import NO_SCOPE, Scope
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.upstream.byte_relay import BACKEND_HEADER
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet, run_emulator, set_faults
from prefix_sidecar_tools.emulator.tokenizer import token_ids
from prefix_sidecar_tools.harness import free_port
from tests.fake_pod import start_site
from tests.kv_events.test_residency import BLOCK, stored_chunks
from tests.server.conftest import running_sidecar, sidecar_config, wait_for
from tests.upstream.test_pod_faults import counted

POD = EmulatorConfig(time_scale=1000.0, block_size=16, kv_tokens=256 * 16, kv_events="map")
PRECISE = "prefix_sidecar_precise_decisions_total"
TEXT = "Merchant handbook, section {n}: refunds within 7 days, no coupon stacking. " * 12


def test_the_block_map_counts_each_pods_leading_blocks() -> None:
    blocks = FleetBlocks()
    tokens = list(range(1, 1 + 4 * BLOCK))
    for pod in ("a", "b"):
        blocks.reset(pod, known=True)
    blocks.apply("a", tuple(stored_chunks(tokens, 10)))
    blocks.apply("b", tuple(stored_chunks(tokens[: 2 * BLOCK], 10)))
    assert blocks.matches([*tokens, 7, 8]) == {"a": 4, "b": 2}
    blocks.apply("a", (BlockRemoved((11,)),))  # its second block evicted
    assert blocks.matches(tokens) == {"a": 1, "b": 2}
    blocks.reset("b", known=False)
    assert blocks.matches(tokens) == {"a": 1}


def test_the_block_map_counts_the_pods_own_cache_not_an_offloaded_copy() -> None:
    blocks = FleetBlocks()
    tokens = list(range(1, 1 + 3 * BLOCK))
    blocks.reset("a", known=True)
    blocks.apply("a", tuple(stored_chunks(tokens, 10, medium="GPU")))
    blocks.apply("a", tuple(stored_chunks(tokens, 10, medium="CPU")))
    blocks.apply("a", (BlockRemoved((12,), medium="CPU"),))
    assert blocks.matches(tokens) == {"a": 3}
    blocks.apply("a", (BlockRemoved((12,), medium="GPU"),))
    assert blocks.matches(tokens) == {"a": 2}


def test_a_pod_over_the_cap_keeps_only_its_latest_blocks() -> None:
    blocks = FleetBlocks(max_blocks_per_pod=2)
    blocks.reset("a", known=True)
    tokens = list(range(1, 1 + 4 * BLOCK))
    blocks.apply("a", tuple(stored_chunks(tokens, 10)))
    assert blocks.matches(tokens) == {}  # the first two blocks were forgotten


MESSAGES = [("user", "Hi?"), ("assistant", "x"), ("user", "And then?")]


def organic_pick(sidecar: Sidecar, chat: bool, head: str) -> str:
    """The organic decision for what `send` sends, before precise routing moves it."""
    if chat:
        return sidecar.pools.default.router.for_chat([("system", head), *MESSAGES]).backend
    return sidecar.pools.default.router.for_prompt(head + " And then?").backend


@pytest.mark.parametrize("path", ["grpc-complete", "grpc-chat", "http-completions", "http-chat"])
async def test_a_prompt_cached_elsewhere_goes_where_it_is_cached(tmp_path: Path, path: str) -> None:
    async with precise_sidecar(tmp_path, 3, front=True) as (fleet, session, sidecar, stub):
        head = TEXT.format(n=path)
        chat = path.endswith("chat")
        cached = await cached_elsewhere(sidecar, fleet.urls, session, head, chat)

        front = front_url(sidecar)
        assert await send(path, stub, session, front, head) == cached
        assert counted(sidecar.metrics, PRECISE, outcome="moved") == 1

        # No pod holds a cold prompt: it stays on its organic pick, unless that pod was
        # sent far more new content lately than the rest (here, the cold prompt just
        # sent): then it goes to the emptiest pod.
        heads = [f"{n:02d} cold starts. " * 40 for n in range(64)]  # no block alike
        stays = next(h for h in heads if organic_pick(sidecar, chat, h) != cached)
        pick = organic_pick(sidecar, chat, stays)
        assert await send(path, stub, session, front, stays) == pick
        assert counted(sidecar.metrics, PRECISE, outcome="cold") == 1
        moves = next(h for h in heads if h != stays and organic_pick(sidecar, chat, h) == pick)
        assert await send(path, stub, session, front, moves) not in (pick, cached)
        assert counted(sidecar.metrics, PRECISE, outcome="placed") == 1


async def cached_elsewhere(
    sidecar: Sidecar, urls: list[str], session: aiohttp.ClientSession, head: str, chat: bool
) -> str:
    """Send `head` straight to a pod the organic decision does not pick, once the sidecar
    follows every pod's events; that pod, once its blocks are in the sidecar's map."""
    kv_events = sidecar.pools.default.kv_events
    assert kv_events is not None and kv_events.blocks is not None
    await wait_for(lambda: len(kv_events.subscriber.feeds) == len(urls), 5)
    pick = organic_pick(sidecar, chat, head)
    cached = next(url for url in urls if url != pick)
    body: dict[str, object] = {"model": POD.model, "max_tokens": 1}
    if chat:
        body["messages"] = [{"role": "system", "content": head}, {"role": "user", "content": "Hi?"}]
    else:
        body["prompt"] = head
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(cached + endpoint, json=body) as answer:
        assert answer.status == 200
    blocks = kv_events.blocks
    await wait_for(lambda: blocks.block_count(cached) > 0, 5, "the pod's blocks")
    return cached


@contextlib.asynccontextmanager
async def precise_sidecar(
    tmp_path: Path, pods: int, pod: EmulatorConfig = POD, front: bool = False
) -> AsyncIterator[tuple[EmulatorFleet, aiohttp.ClientSession, Sidecar, Any]]:
    """`pods` emulated pods publishing KV events, a client session for them, and a sidecar
    with precise routing following them (with its gRPC stub; `front`: and its HTTP front,
    at front_url)."""
    async with EmulatorFleet(pods, pod) as fleet, aiohttp.ClientSession() as session:
        # the port asked once the pods (and their KV-event sockets) hold theirs: asked before,
        # the kernel once gave it to one of them (address already in use, in CI)
        listen = {"openai_listen": f"127.0.0.1:{free_port()}"} if front else {}
        settings = sidecar_config(
            tmp_path, fleet.urls, kv_events=True, unregistered_routing="precise", **listen
        )
        async with running_sidecar(settings) as (sidecar, stub):
            yield fleet, session, sidecar, stub


def front_url(sidecar: Sidecar) -> str:
    return f"http://{sidecar.config.openai_listen}"


async def test_a_busy_pick_is_not_waited_for_its_token_ids(tmp_path: Path) -> None:
    """The organic pick's /tokenize stalls past the 0.5 s bound (a queueing pod, seen on real
    vLLM): the next pod of the preference is asked beside it, and the prompt still goes to
    the pod that holds it."""
    async with precise_sidecar(tmp_path, 3) as (fleet, session, sidecar, stub):
        head = TEXT.format(n="busy")
        cached = await cached_elsewhere(sidecar, fleet.urls, session, head, chat=False)
        await set_faults(organic_pick(sidecar, False, head), tokenize_stall_seconds=5.0)
        started = time.monotonic()
        assert await send("grpc-complete", stub, session, "", head) == cached
        elapsed = time.monotonic() - started
        assert counted(sidecar.metrics, PRECISE, outcome="moved") == 1
        assert counted(sidecar.metrics, PRECISE, outcome="tokenize_error") == 0
    assert elapsed < 5.0  # the stalled pick was not waited for


async def test_a_failed_pick_has_the_next_pod_asked_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pick whose /tokenize fails (a 500) is not waited on for the hedge: the next pod of
    the preference is asked as soon as the failure is in."""
    monkeypatch.setattr(precise, "TOKENIZE_HEDGE_S", 5.0)
    failing = web.Application()
    failing.router.add_post("/tokenize", refuse)
    runner, broken = await start_site(failing)
    try:
        async with run_emulator(POD) as pod, UpstreamClient() as client:
            routing = PreciseRouting(client, FleetBlocks(), cast(Any, None))
            decision = Decision(broken, [broken, pod], None, 0, Branch.HOME, 0, 0)
            started = time.monotonic()
            tokens = await routing.tokens(decision, {"prompt": "rules " * 50}, POD.model)
            assert tokens == token_ids(("rules " * 50).encode(), POD.vocab_size)
            assert time.monotonic() - started < 2.5  # not the 5 s hedge
    finally:
        await runner.cleanup()


async def refuse(_request: web.Request) -> web.Response:
    return web.Response(status=500)


async def send(path: str, stub: Any, session: aiohttp.ClientSession, front: str, head: str) -> str:
    """One request for `head` and a question on `path`; the pod that served it."""
    messages = [("system", head), *MESSAGES]
    if path == "grpc-complete":
        complete = router_pb2.CompleteRequest(input=head + " And then?", max_tokens=1)
        chunks = [c async for c in stub.Complete(complete, timeout=10)]
        return str(chunks[0].backend)
    if path == "grpc-chat":
        request = router_pb2.ChatRequest(
            messages=[router_pb2.ChatMessage(role=r, content=c) for r, c in messages], max_tokens=1
        )
        chunks = [c async for c in stub.Chat(request, timeout=10)]
        return str(chunks[0].backend)
    body: dict[str, object] = {"model": POD.model, "max_tokens": 1}
    if path == "http-chat":
        body["messages"] = [{"role": r, "content": c} for r, c in messages]
        endpoint = "/v1/chat/completions"
    else:
        body["prompt"] = head + " And then?"
        endpoint = "/v1/completions"
    async with session.post(front + endpoint, json=body) as answer:
        assert answer.status == 200, await answer.text()
        return answer.headers[BACKEND_HEADER]


async def test_a_grpc_call_is_tokenized_under_the_model_it_names(tmp_path: Path) -> None:
    """The caller's `model`, not the sidecar's default, names the tokenizer on /tokenize: a
    default the pods do not serve would make every /tokenize a 404."""
    async with EmulatorFleet(2, POD) as fleet:
        settings = sidecar_config(
            tmp_path, fleet.urls, kv_events=True, unregistered_routing="precise", model="unserved"
        )
        async with running_sidecar(settings) as (sidecar, stub):
            precise = sidecar.pools.default.router.precise
            assert precise is not None
            asked: list[str] = []
            refine = precise.refine

            async def recorded(
                decision: Any, what: dict[str, Any], model: str = "", scope: Scope = NO_SCOPE
            ) -> Any:
                asked.append(model)
                return await refine(decision, what, model, scope)

            precise.refine = recorded  # type: ignore[method-assign]
            request = router_pb2.CompleteRequest(input=TEXT, max_tokens=1, model=POD.model)
            assert [c async for c in stub.Complete(request, timeout=10)]
            assert asked == [POD.model]
            assert counted(sidecar.metrics, PRECISE, outcome="tokenize_error") == 0


async def test_a_pod_that_evicts_a_prompt_just_sent_there_is_no_longer_credited_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the pod's first token came, its events are the truth (kv_events/expected.py): a
    prompt sent there and dropped at once (a cache reset) is not credited to it for the rest
    of EXPECT_S, so a repeat goes to the pod that holds it, not back to recompute."""
    monkeypatch.setattr(expected, "EXPECT_S", 60.0)  # the credit would outlast the test
    async with precise_sidecar(tmp_path, 2) as (fleet, session, sidecar, stub):
        kv_events = sidecar.pools.default.kv_events
        assert kv_events is not None and kv_events.blocks is not None
        blocks = kv_events.blocks
        await wait_for(lambda: len(kv_events.subscriber.feeds) == 2, 5)
        warm = {"model": POD.model, "prompt": TEXT.format(n="known"), "max_tokens": 1}
        async with session.post(fleet.urls[0] + "/v1/completions", json=warm) as answer:
            assert answer.status == 200  # a pod's blocks known: prompts are tokenized, credited
        await wait_for(lambda: blocks.block_count(fleet.urls[0]) > 0, 5, "the pods' blocks")
        head = TEXT.format(n="dropped")
        sent = await send("grpc-complete", stub, session, "", head)
        assert organic_pick(sidecar, False, head) == sent  # a repeat's own pick: back there
        other = next(url for url in fleet.urls if url != sent)
        body = {"model": POD.model, "prompt": head + " And then?", "max_tokens": 1}
        async with session.post(other + "/v1/completions", json=body) as answer:
            assert answer.status == 200
        async with session.post(sent + "/reset_prefix_cache") as answer:
            assert answer.status == 200
        await wait_for(lambda: blocks.block_count(other) > 0, 5, "the other pod's blocks")
        await wait_for(lambda: blocks.block_count(sent) == 0, 5, "the reset pod's removal")
        assert await send("grpc-complete", stub, session, "", head) == other
        assert counted(sidecar.metrics, PRECISE, outcome="moved") == 1
