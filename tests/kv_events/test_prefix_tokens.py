"""A prefix's token ids from a pod's /tokenize (a real HTTP server here): what a pod answers
is checked before the residency uses it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from prefix_sidecar.kv_events.prefix_tokens import PrefixTokens
from prefix_sidecar.kv_events.residency import Residency
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.tokenize import TokenizeError, token_ids


@contextlib.asynccontextmanager
async def tokenizer(answer: Any, status: int = 200) -> AsyncIterator[str]:
    async def tokenize(_: web.Request) -> web.Response:
        return web.json_response(answer, status=status)

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def test_a_registered_prefix_is_watched_with_the_pods_ids() -> None:
    store, residency = PrefixStore(), Residency()
    async with tokenizer({"tokens": [1, 2, 3, 4, 5]}) as url, UpstreamClient() as client:
        entry, _ = store.register("p", "hello")
        prefix_tokens = PrefixTokens(store, client, residency, lambda: [url])
        await prefix_tokens.run_pass()
        assert prefix_tokens.learnt.keys() == {entry.id}
        # Its size is the pods' count from then on, with its residency (not after the sizer).
        assert store.get(entry.id).tokens == 5
        store.unregister_name("p")
        await prefix_tokens.run_pass()
        assert not prefix_tokens.learnt


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        ({"tokens": [1, 2]}, 500),
        ({"count": 2}, 200),
        ([1, 2], 200),
        ({"tokens": [1, -2]}, 200),
        ({"tokens": [1, True]}, 200),
        ({"tokens": [1, "2"]}, 200),
        ({"tokens": list(range(100))}, 200),  # more ids than the text has bytes
    ],
)
async def test_bad_answers_are_refused(answer: Any, status: int) -> None:
    store, residency = PrefixStore(), Residency()
    async with tokenizer(answer, status) as url, UpstreamClient() as client:
        store.register("p", "hello")
        prefix_tokens = PrefixTokens(store, client, residency, lambda: [url])
        with pytest.raises(TokenizeError):
            await token_ids(client, url, "hello")
        await prefix_tokens.run_pass()
        assert not prefix_tokens.learnt and len(prefix_tokens.failures) == 1
