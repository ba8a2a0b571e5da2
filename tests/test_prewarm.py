"""The prewarmer (prefix_sidecar/prewarm.py): per-pod slots, free during a backoff, jittered retries
(issue 11 item 12). Pods are small aiohttp servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.prewarm import RETRYING, WARMED, Prewarmer
from prefix_sidecar.upstream.client import UpstreamClient
from tests.fake_pod import start_site

# --- Prewarmer: per-pod slots, released during backoff, jitter ------------------------------


def sse_usage() -> bytes:
    events = [
        {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1}},
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return body + b"data: [DONE]\n\n"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def pod(handler: Handler) -> AsyncIterator[str]:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", handler)
    runner, base_url = await start_site(app, access_log=None, shutdown_timeout=0.2)
    try:
        yield base_url
    finally:
        await runner.cleanup()


async def answer(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(sse_usage())
    await response.write_eof()
    return response


async def test_a_slot_is_free_during_a_backoff() -> None:
    """One slot on the pod; pair A fails first (503) and backs off 1 s: pair B is warmed
    during that backoff, not after A's retries."""
    failed_once: set[bytes] = set()

    async def first_503(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if body.startswith(b'{"prompt":"A') and body not in failed_once:
            failed_once.add(body)
            return web.Response(status=503, text="busy")
        return await answer(request)

    store = PrefixStore()
    first, _ = store.register("A", "A" * 100)
    second, _ = store.register("B", "B" * 100)
    client = UpstreamClient()
    try:
        async with pod(first_503) as url:
            warmer = Prewarmer(client, concurrency=1, attempts=2, backoff_s=1.0, timeout_s=5)
            seen: list[tuple[str, str, float]] = []
            started = time.monotonic()
            async for event in warmer.run([(first, url), (second, url)]):
                seen.append((event.prefix_id, event.state, time.monotonic() - started))
    finally:
        await client.close()
    order = [(prefix_id, state) for prefix_id, state, _ in seen]
    assert order.index((first.id, RETRYING)) < order.index((second.id, WARMED))
    assert order.index((second.id, WARMED)) < len(order) - 1  # before A's retry ends
    b_warmed = next(t for p, s, t in seen if (p, s) == (second.id, WARMED))
    assert b_warmed < 0.5, f"B waited for A's backoff: {seen}"
    assert warmer._slots == {}  # no state kept for an idle pod


async def test_a_wedged_pod_does_not_take_another_pods_slots() -> None:
    """concurrency 1: a pod whose completions hang holds its own slot only."""
    hang = asyncio.Event()

    async def wedged(request: web.Request) -> web.StreamResponse:
        await hang.wait()
        return await answer(request)

    store = PrefixStore()
    entries = [store.register(f"p{i}", f"prefix {i}")[0] for i in range(3)]
    client = UpstreamClient()
    try:
        async with pod(wedged) as stuck, pod(answer) as healthy:
            warmer = Prewarmer(client, concurrency=1, attempts=1, timeout_s=30)
            stuck_task = asyncio.create_task(warmer.warm_all([(e, stuck) for e in entries]))
            await asyncio.sleep(0.1)
            finals = await asyncio.wait_for(
                warmer.warm_all([(e, healthy) for e in entries]), timeout=2.0
            )
            hang.set()
            await stuck_task
    finally:
        await client.close()
    assert [e.state for e in finals] == [WARMED] * 3


async def test_the_prewarm_prompt_is_the_prefix_as_registered_trailing_whitespace_too() -> None:
    """The prewarm sends the prefix text byte for byte, whitespace at its end included: the
    tokens it warms then cover every whole block a query's tokens can share with it (the
    reason is in Prewarmer._complete; the vLLM measurement in tests/vllm/)."""
    texts = ["rules end with a space ", "rules end with newlines.\n\n", "a tab\t", "none."]
    prompts: list[str] = []

    async def recording(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        prompts.append(body["prompt"])
        assert body["max_tokens"] == 1
        return await answer(request)

    store = PrefixStore()
    entries = [store.register(f"p{i}", text)[0] for i, text in enumerate(texts)]
    client = UpstreamClient()
    try:
        async with pod(recording) as url:
            finals = await Prewarmer(client, timeout_s=5).warm_all([(e, url) for e in entries])
    finally:
        await client.close()
    assert [e.state for e in finals] == [WARMED] * len(texts)
    assert sorted(prompts) == sorted(texts)


def test_backoff_is_jittered_around_the_exponential_step() -> None:
    warmer = Prewarmer(UpstreamClient(), backoff_s=0.2)
    for attempt in (1, 2, 3):
        step = 0.2 * 2 ** (attempt - 1)
        delays = [warmer._backoff(attempt) for _ in range(200)]
        assert all(0.5 * step <= d <= 1.5 * step for d in delays)
        assert len(set(delays)) > 100  # not in lockstep
