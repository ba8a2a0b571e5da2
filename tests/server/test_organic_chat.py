"""Organic routing of chats through a real sidecar (gRPC Chat and the HTTP front's
/v1/chat/completions) before six emulator pods: every turn of a session is served by one
pod, and the sessions of one tenant are spread over several (routing contract 9). The first
turn starts the flow and may go to any pod of the tenant's home set (9f); the sidecar that
sent it sends the next turns there (session follow, 9h). Without session follow a session
whose start went elsewhere continues on its session's pod. The same conversations rendered
in ChatML and sent as raw prompts (gRPC Complete, /v1/completions) are followed by their
template's assistant turns.

"Served by" is read from the pods' own request counters (gRPC) or the front's backend
header, not from the router.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from prefix_sidecar.routing import organic
from prefix_sidecar.upstream.byte_relay import BACKEND_HEADER
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import run_emulator
from prefix_sidecar_tools.emulator.protocol import render_chat

from .conftest import FAST, collect, free_port, requests_per_pod, running_sidecar, sidecar_config

WORDS = ("coupon", "stacking", "voucher", "refund", "parcel", "jacket", "discount", "policy")
SYSTEM = "You are the assistant of store #3. Coupons stack with vouchers only. " * 12
SESSIONS, TURNS = 10, 4
RINGS = 3


def prose(rng: random.Random, size: int) -> str:
    text = ""
    while len(text) < size:
        text += " ".join(rng.choice(WORDS) for _ in range(9)) + ". "
    return text[:size]


def sessions(seed: int) -> list[list[list[tuple[str, str]]]]:
    """SESSIONS sessions of one tenant, each as its TURNS growing message lists."""
    rng = random.Random(seed)
    result = []
    for _ in range(SESSIONS):
        history = [("system", SYSTEM)]
        turns = []
        for turn in range(TURNS):
            if turn:
                history.append(("assistant", prose(rng, 200)))
            history.append(("user", f"Turn {turn}: {prose(rng, 120)}"))
            turns.append(list(history))
        result.append(turns)
    return result


@contextlib.asynccontextmanager
async def six_pods() -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(run_emulator(FAST, port=0)) for _ in range(6)]


def _grpc(messages: list[tuple[str, str]]) -> router_pb2.ChatRequest:
    return router_pb2.ChatRequest(
        messages=[router_pb2.ChatMessage(role=r, content=c) for r, c in messages], max_tokens=1
    )


async def _grpc_chat(stub: Any, pods: list[str], messages: list[tuple[str, str]]) -> str:
    before = await requests_per_pod(pods)
    chunks = await collect(stub.Chat(_grpc(messages)))
    after = await requests_per_pod(pods)
    served = [url for url in pods if after[url] != before[url]]
    assert served == [chunks[0].backend]
    return served[0]


def _chatml(messages: list[tuple[str, str]]) -> str:
    return render_chat([{"role": r, "content": c} for r, c in messages])


async def _grpc_complete(stub: Any, pods: list[str], messages: list[tuple[str, str]]) -> str:
    """A conversation rendered by the caller, sent whole as the Complete RPC's input."""
    before = await requests_per_pod(pods)
    request = router_pb2.CompleteRequest(input=_chatml(messages), max_tokens=1)
    chunks = await collect(stub.Complete(request))
    after = await requests_per_pod(pods)
    served = [url for url in pods if after[url] != before[url]]
    assert served == [chunks[0].backend]
    return served[0]


def _check(where: dict[int, set[str]]) -> None:
    assert all(len(used) == 1 for used in where.values()), where  # each session: one pod
    assert len(set.union(*where.values())) >= 3, where  # the tenant's sessions: several


async def _grpc_sessions(tmp_path: Path, follow: bool, raw: bool = False) -> dict[int, list[str]]:
    """Each session's pods, turn by turn, through a real sidecar's Chat RPC (`raw`: its
    Complete RPC, each request the conversation rendered in ChatML)."""
    send = _grpc_complete if raw else _grpc_chat
    async with six_pods() as pods:
        config = sidecar_config(tmp_path, pods)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(organic, "FOLLOW_SESSIONS", follow)  # read as the sidecar starts
            async with running_sidecar(config) as (_, stub):
                rng = random.Random(1)
                for _ in range(50):  # one-shot questions: the tenant's share and branch are learnt
                    await send(stub, pods, [("system", SYSTEM), ("user", prose(rng, 80))])
                where: dict[int, list[str]] = {i: [] for i in range(SESSIONS)}
                flows = sessions(2)
                for turn in range(TURNS):  # interleaved, as concurrent users would send them
                    for i, flow in enumerate(flows):
                        where[i].append(await send(stub, pods, flow[turn]))
    return where


async def _unfollowed_rings(tmp_path: Path, raw: bool) -> AsyncIterator[dict[int, list[str]]]:
    """Sessions without follow, on up to RINGS fleets (fresh ports: fresh rings). Where a
    start goes against its session's pod depends on the ring: on a rare one all ten agree."""
    for _ in range(RINGS):
        yield await _grpc_sessions(tmp_path, follow=False, raw=raw)


async def test_grpc_chat_keeps_a_session_on_one_pod_and_spreads_a_tenant(tmp_path: Path) -> None:
    where = await _grpc_sessions(tmp_path, follow=True)
    _check({i: set(pods) for i, pods in where.items()})
    # Without follow the later turns still share one pod, but not always the start's.
    async for unfollowed in _unfollowed_rings(tmp_path, raw=False):
        _check({i: set(pods[1:]) for i, pods in unfollowed.items()})
        if any(pods[0] != pods[1] for pods in unfollowed.values()):
            return
    raise AssertionError(f"every start on its session's pod, on {RINGS} rings: {unfollowed}")


async def test_grpc_complete_follows_a_chatml_conversation(tmp_path: Path) -> None:
    where = await _grpc_sessions(tmp_path, follow=True, raw=True)
    _check({i: set(pods) for i, pods in where.items()})
    async for unfollowed in _unfollowed_rings(tmp_path, raw=True):
        if any(len(set(pods)) > 1 for pods in unfollowed.values()):
            return
    raise AssertionError(f"no session left its pod, on {RINGS} rings: {unfollowed}")


async def _http_sessions(
    tmp_path: Path, path: str, body_of: Callable[[list[tuple[str, str]], int], dict[str, Any]]
) -> dict[int, set[str]]:
    """Each session's pods through a real sidecar's HTTP front (`path`), read from the
    front's backend header; `body_of(messages, turn)`: the request's body fields."""
    port = free_port()
    async with six_pods() as pods:
        config = sidecar_config(tmp_path, pods, openai_listen=f"127.0.0.1:{port}")
        async with running_sidecar(config), aiohttp.ClientSession() as http:

            async def send(messages: list[tuple[str, str]], turn: int) -> str:
                body = {"model": "Qwen2.5-72B-Instruct", "max_tokens": 1, **body_of(messages, turn)}
                async with http.post(f"http://127.0.0.1:{port}{path}", json=body) as reply:
                    assert reply.status == 200, await reply.text()
                    await reply.read()
                    return reply.headers[BACKEND_HEADER]

            rng = random.Random(3)
            for _ in range(50):
                await send([("system", SYSTEM), ("user", prose(rng, 80))], 0)
            where: dict[int, set[str]] = {i: set() for i in range(SESSIONS)}
            flows = sessions(4)
            for turn in range(TURNS):
                for i, flow in enumerate(flows):
                    where[i].add(await send(flow[turn], turn))
    return where


async def test_http_chat_keeps_a_session_on_one_pod_and_spreads_a_tenant(tmp_path: Path) -> None:
    def content(text: str) -> Any:
        half = len(text) // 2  # as text parts, it routes as the same text
        return [{"type": "text", "text": t} for t in (text[:half], text[half:])]

    def body_of(messages: list[tuple[str, str]], turn: int) -> dict[str, Any]:
        parts = turn % 2 == 1
        return {
            "messages": [{"role": r, "content": content(c) if parts else c} for r, c in messages]
        }

    _check(await _http_sessions(tmp_path, "/v1/chat/completions", body_of))


async def test_http_completions_follow_a_chatml_conversation(tmp_path: Path) -> None:
    """/v1/completions with the conversation rendered by the caller: the front reads the
    template's last assistant headers where the prompt lies in the body (its fast path
    decodes only the prompt's head)."""
    where = await _http_sessions(
        tmp_path, "/v1/completions", lambda messages, _: {"prompt": _chatml(messages)}
    )
    _check(where)
