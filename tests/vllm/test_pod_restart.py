"""A real vLLM pod killed mid-run, then restarted on its port (issue 28), under a real
`prefix-sidecar serve` with a prefix registered, prewarmed and replicated on both pods.

Thin queries stream through gRPC Complete and the HTTP front while pod 0 is SIGKILLed (its
whole process group, as a crash would; frozen for 0.3 s first, so that the kill is sure to
meet an answer mid-stream). What the test holds, and what a caller sees:
- no request is lost: each one is answered whole, or, if its stream had already carried
  tokens from the killed pod, ends with a clear error (gRPC UNAVAILABLE "broke after the
  first token"; over HTTP, an SSE error event after the partial text). A request that had
  no token yet is failed over to the other pod (gRPC's `Chunk.attempts` is then 2), never
  refused;
- the pod restarts on the same port; the sidecar's health checks see it back, it is
  prewarmed before it joins the ring (warm before serve), and its first routed request is
  served with the prefix's whole blocks from its cache, as vLLM's own usage reports. vLLM's
  prefix-cache counters on that pod account for every token it was sent: the prewarm (all
  misses, a fresh process has an empty cache) and the routed requests, nothing else.

The shared two-pod fleet is left as it was found: pod 0 runs again on its port (cold, but
every other module uses texts of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from prefix_sidecar.upstream.byte_relay import BACKEND_HEADER
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.vllm.fleet import VllmFleet
from prefix_sidecar_tools.vllm.reports import (
    cache_counters,
    cached_tokens,
    tokenize,
    whole_blocks,
)
from prefix_sidecar_tools.vllm.tiny_model import document
from tests.vllm.conftest import VLLM_TESTS, register_prewarmed, serving_sidecar

# The fleet may start inside this test (when the module runs alone), then pod 0 restarts:
# two pod starts, each bounded by the fleet's STARTUP_TIMEOUT_S.
pytestmark = [pytest.mark.timeout(900), *VLLM_TESTS]  # the first timeout mark counts

VICTIM = 0
SURVIVOR = 1
WORKERS_PER_FRONT = 2
# Answers run their full length (no early end of text): a stream seen in its first quarter
# of tokens (counted in the pod's own events: the relay may pack several into one chunk)
# usually has ~140 to go when pod 0 is frozen before its kill
ANSWER_TOKENS = 192
FREEZE_TRIES = 5
DRAIN_S = 0.3  # a frozen pod's last bytes reach the callers (health checks run each 0.5 s)
NO_EARLY_END = json.dumps({"ignore_eos": True})
BROKEN_GRPC = "broke after the first token"
BROKEN_HTTP = "broke after the first byte"


@dataclass
class Outcome:
    """One query as its caller saw it."""

    front: str  # "grpc" or "http"
    started: float  # time.monotonic() when it was sent
    backend: str = ""  # the pod that streamed it
    attempts: int = 0  # gRPC's Chunk.attempts: 1 on the first pod tried, 2 after a failover
    text_chunks: int = 0
    tokens: int = 0  # text pieces in the pod's events (gRPC: raw_events)
    finished: bool = False  # a finish_reason came: the answer is whole
    error: str = ""  # what the caller was told, when it failed
    prompt_tokens: int = 0  # from vLLM's own usage event
    cached: int = 0

    @property
    def partial(self) -> bool:
        """Failed after text had come: the error the test allows, and only that."""
        broken = BROKEN_GRPC if self.front == "grpc" else BROKEN_HTTP
        return bool(self.error) and broken in self.error and self.text_chunks > 0


def read_usage(outcome: Outcome, event: dict[str, Any]) -> None:
    usage = event.get("usage")
    if usage:
        outcome.prompt_tokens = int(usage["prompt_tokens"])
        outcome.cached = cached_tokens(usage)


async def grpc_query(
    stub: router_pb2_grpc.RouterStub, prefix_id: str, query: str, into: list[Outcome]
) -> Outcome:
    """One Complete; its outcome is in `into` from the start, and filled as chunks come."""
    outcome = Outcome("grpc", time.monotonic())
    into.append(outcome)
    request = router_pb2.CompleteRequest(
        prefix_id=prefix_id,
        input=query,
        max_tokens=ANSWER_TOKENS,
        temperature=0.0,
        raw_events=True,
        extra_json=NO_EARLY_END,
    )
    pending = ""  # an event cut across chunks (event_continues)
    try:
        async for chunk in stub.Complete(request, timeout=60):
            outcome.backend = outcome.backend or chunk.backend
            outcome.attempts = max(outcome.attempts, chunk.attempts)
            outcome.text_chunks += bool(chunk.text)
            outcome.finished = outcome.finished or bool(chunk.finish_reason)
            for number, piece in enumerate(chunk.events):
                pending += piece
                if number == len(chunk.events) - 1 and chunk.event_continues:
                    break
                event = json.loads(pending)
                outcome.tokens += sum(bool(c.get("text")) for c in event.get("choices") or ())
                read_usage(outcome, event)
                pending = ""
    except grpc.aio.AioRpcError as exc:
        outcome.error = f"{exc.code().name}: {exc.details()}"
    return outcome


async def http_query(
    session: aiohttp.ClientSession, front: str, prompt: str, into: list[Outcome]
) -> Outcome:
    """One streamed /v1/completions through the HTTP front, recorded as grpc_query does."""
    outcome = Outcome("http", time.monotonic())
    into.append(outcome)
    body = {
        "prompt": prompt,
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(f"{front}/v1/completions", json=body) as resp:
        outcome.backend = resp.headers.get(BACKEND_HEADER, "")
        if resp.status != 200:
            outcome.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            return outcome
        async for line in resp.content:
            data = line.strip().removeprefix(b"data: ")
            if not data or data == b"[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                outcome.error = str(event["error"].get("message"))
                continue
            for choice in event.get("choices") or ():
                outcome.text_chunks += bool(choice.get("text"))
                outcome.finished = outcome.finished or bool(choice.get("finish_reason"))
            read_usage(outcome, event)
    return outcome


async def run_until(stop: asyncio.Event, query: Callable[[int], Awaitable[Outcome]]) -> None:
    """One caller: queries back to back (each its own question) until `stop` is set."""
    number = 0
    while not stop.is_set():
        await query(number)
        number += 1


async def backend_is(stub: router_pb2_grpc.RouterStub, url: str, state: str) -> bool:
    """The sidecar's view of pod `url` (ListBackends): "warming", "serving" or "ejected"."""
    reply = await stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=10)
    (backend,) = [b for b in reply.backends if b.url == url]
    return bool(backend.state == state)


@contextlib.asynccontextmanager
async def restored(fleet: VllmFleet, index: int) -> AsyncIterator[None]:
    """Pod `index` runs again when the block ends, however it ends (killed, or left frozen
    by a failure between freeze and kill): later modules share the fleet."""
    try:
        yield
    finally:
        process = fleet.pods[index].process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                fleet.freeze(index, False)  # stopped between its freeze and its kill
        elif process is not None:
            await fleet.restart(index)


async def wait_for(what: str, check: Callable[[], Awaitable[bool]], timeout: float) -> float:
    """Poll `check` until it holds; the seconds that took (AssertionError after `timeout`)."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < timeout, f"not {what} after {timeout} s"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def test_a_killed_pod_fails_over_then_comes_back_warm(
    fleet: VllmFleet, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    victim, survivor = fleet.urls[VICTIM], fleet.urls[SURVIVOR]
    prefix = document("pod-restart", 2400)  # ends with a full stop; queries start with a space
    prefix_ids = await tokenize(session, survivor, fleet.model, prefix)
    block = (await cache_counters(session, survivor)).block_size
    expected = whole_blocks(len(prefix_ids), block)

    async with (
        restored(fleet, VICTIM),
        serving_sidecar(fleet, tmp_path) as (sidecar, front),
        grpc.aio.insecure_channel(sidecar.target) as channel,
    ):
        stub = router_pb2_grpc.RouterStub(channel)
        registered = await register_prewarmed(stub, "restart", prefix, replicas=len(fleet.urls))
        assert sorted(registered.backends) == sorted(fleet.urls)
        warmed = {e.backend for e in registered.prewarm if e.state == e.WARMED}
        assert warmed == set(fleet.urls), registered.prewarm

        def callers(
            stop: asyncio.Event, phase: str, outcomes: list[Outcome]
        ) -> asyncio.Future[Any]:
            """Callers on both fronts, each query a question of its own."""

            def by_grpc(worker: int) -> Callable[[int], Awaitable[Outcome]]:
                question = f" {phase} {worker}.{{}}: why?"
                return lambda n: grpc_query(stub, registered.id, question.format(n), outcomes)

            def by_http(worker: int) -> Callable[[int], Awaitable[Outcome]]:
                prompt = f"{prefix} {phase} {worker}.{{}}: why?"
                return lambda n: http_query(session, front, prompt.format(n), outcomes)

            makers = [by_grpc(w) for w in range(WORKERS_PER_FRONT)]
            makers += [by_http(w) for w in range(WORKERS_PER_FRONT)]
            return asyncio.gather(*(run_until(stop, make) for make in makers))

        # --- the kill: traffic on both pods, then pod 0 dies as in a crash -----------------
        stop = asyncio.Event()
        killed_run: list[Outcome] = []
        running = callers(stop, "before", killed_run)

        async def streaming_from_victim() -> bool:
            """A gRPC answer is coming from pod 0, its first token sent, most of it to come."""
            return any(
                o.front == "grpc"
                and o.backend == victim
                and 0 < o.tokens <= ANSWER_TOKENS // 4
                and not o.finished
                for o in killed_run
            )

        async def cut_by_a_kill() -> bool:
            """A gRPC answer from pod 0 has tokens and is still unfinished."""
            return any(
                o.front == "grpc" and o.backend == victim and o.tokens and not o.finished
                for o in killed_run
            )

        # pod 0 is frozen first: what it had sent reaches its callers, and an answer still
        # unfinished then is sure to be cut (a tiny model can finish one in the ~0.1 s a
        # SIGKILL takes to land: CI once saw no stream cut)
        freezes = 0
        while freezes < FREEZE_TRIES:
            await wait_for("streaming from pod 0", streaming_from_victim, timeout=60)
            freezes += 1
            fleet.freeze(VICTIM, True)
            await asyncio.sleep(DRAIN_S)
            if await cut_by_a_kill():
                break
            fleet.freeze(VICTIM, False)
        else:
            raise AssertionError(f"every answer seen from pod 0 ended in {DRAIN_S} s")
        killed_at = time.monotonic()
        exit_code = await fleet.kill(VICTIM)
        dead_at = time.monotonic()
        ejected_s = await wait_for(
            "ejected", lambda: backend_is(stub, victim, "ejected"), timeout=10
        )
        await asyncio.sleep(1.5)  # traffic on the survivor alone for a while
        stop.set()
        await running

        # --- the restart: same port, warmed before it serves -----------------------------
        restart_started = time.monotonic()
        ready_s = await fleet.restart(VICTIM)
        assert fleet.urls[VICTIM] == victim
        serving_s = await wait_for(
            "serving again", lambda: backend_is(stub, victim, "serving"), timeout=120
        )
        stop = asyncio.Event()
        after_run: list[Outcome] = []
        running = callers(stop, "after", after_run)

        async def victim_served_twice() -> bool:
            return sum(o.backend == victim for o in after_run) >= 2

        await wait_for("routed to the restarted pod", victim_served_twice, timeout=60)
        stop.set()
        await running
        victim_counters = await cache_counters(session, victim)

    print(
        f"\nprefix {len(prefix_ids)} tokens, block {block}, whole blocks {expected}; "
        f"pod {victim} frozen {freezes}x, SIGKILLed (exit {exit_code}) "
        f"in {dead_at - killed_at:.2f} s, "
        f"ejected {ejected_s:.2f} s later; restarted in {ready_s:.1f} s, serving "
        f"{serving_s:.1f} s after /health ({time.monotonic() - restart_started:.1f} s in all)"
    )
    _print_run("kill", killed_run, fleet.urls)
    _print_run("after the restart", after_run, fleet.urls)

    # no request lost: whole, or (only if the killed pod had streamed text) a clear error
    for outcome in killed_run + after_run:
        assert outcome.finished != bool(outcome.error), outcome
        if outcome.error:
            assert outcome.partial and outcome.backend == victim, outcome
    # the kill met a stream that had sent tokens: it ended with the clear error; requests
    # with no token yet failed over and were answered whole by the survivor
    assert any(o.front == "grpc" and o.partial for o in killed_run), "no stream was cut"
    assert all(o.backend == survivor and o.finished for o in killed_run if o.attempts >= 2)
    # sent after the kill: only the survivor answers
    after_kill = [o for o in killed_run if o.started > dead_at]
    assert after_kill and all(o.backend == survivor and o.finished for o in after_kill)
    # back on its port, warm before its first routed request, as vLLM counts it
    on_victim = [o for o in after_run if o.backend == victim]
    assert on_victim, "the restarted pod took no routed traffic"
    assert all(o.finished and o.prompt_tokens > len(prefix_ids) for o in after_run)
    assert [o.cached for o in on_victim] == [expected] * len(on_victim)
    first = min(on_victim, key=lambda o: o.started)
    assert first.cached == expected, first
    # vLLM's counters on the new process: the prewarm (all misses) plus the routed requests
    assert victim_counters.queries == len(prefix_ids) + sum(o.prompt_tokens for o in on_victim)
    assert victim_counters.hits == expected * len(on_victim)


def _print_run(name: str, outcomes: list[Outcome], urls: list[str]) -> None:
    for front in ("grpc", "http"):
        mine = [o for o in outcomes if o.front == front]
        per_pod = ", ".join(f"{url}: {sum(o.backend == url for o in mine)}" for url in urls)
        print(
            f"  {name}, {front}: {len(mine)} requests ({per_pod}); "
            f"{sum(o.finished for o in mine)} whole, {sum(o.partial for o in mine)} partial "
            f"with a clear error, {sum(o.attempts >= 2 for o in mine)} failed over"
        )
