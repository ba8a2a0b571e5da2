"""Pools: two models, each on its own emulated pods, behind one `prefix-sidecar serve`
process. A request's model picks its pool on both fronts (aliases too), an unknown model is
NOT_FOUND / a 404 in OpenAI's shape naming the served models, /v1/models lists every pool,
prefixes are registered per pool, and the request metrics carry the pool."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest

from prefix_sidecar.config import ConfigError, build_config
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.emulator import run_emulator
from prefix_sidecar_tools.harness import SidecarProcess, free_port
from tests.server.conftest import (
    FAST,
    cli_env,
    requests_per_pod,
    running_sidecar,
    sidecar_config,
    socket_path,
)

LARGE = ("qwen2.5-72b-instruct", "qwen-large")
SMALL = ("qwen2.5-7b-instruct",)
RULES = "Rule: no 'lowest price ever' claim without proof. " * 40


@dataclass
class TwoPools:
    sidecar: SidecarProcess
    base: str  # the HTTP front
    metrics: str  # the metrics URL
    pods: dict[str, list[str]]  # pool -> its pods


@contextlib.asynccontextmanager
async def two_pools(tmp_path: Path) -> AsyncIterator[TwoPools]:
    """Two emulated pods of each model and a serve process with both pools."""
    async with contextlib.AsyncExitStack() as stack:
        pods: dict[str, list[str]] = {}
        for name, models in (("large", LARGE), ("small", SMALL)):
            pod = dataclasses.replace(FAST, model=models[0])
            pods[name] = [await stack.enter_async_context(run_emulator(pod)) for _ in range(2)]
        config = tmp_path / "pools.yaml"
        pools = [
            {"name": "large", "models": list(LARGE), "backends": pods["large"]},
            {"name": "small", "models": list(SMALL), "backends": pods["small"]},
        ]
        config.write_text(json.dumps({"pools": pools, "health_interval_s": 0.3}))
        port, metrics_port = free_port(), free_port()
        argv = ["--config", str(config), "--openai-listen", f"127.0.0.1:{port}"]
        sidecar = SidecarProcess(
            socket_path(tmp_path),
            [*argv, "--metrics-port", str(metrics_port)],
            log_path=str(tmp_path / "serve.log"),
            env=cli_env(),
            backends_serving=4,
        )
        await stack.enter_async_context(sidecar)
        yield TwoPools(
            sidecar, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", pods
        )


async def test_each_request_reaches_its_models_pool_on_both_fronts(tmp_path: Path) -> None:
    async with (
        two_pools(tmp_path) as fleet,
        grpc.aio.insecure_channel(fleet.sidecar.target) as channel,
    ):
        stub = router_pb2_grpc.RouterStub(channel)
        backends = await stub.ListBackends(router_pb2.ListBackendsRequest())
        pods = fleet.pods
        assert {b.url: b.pool for b in backends.backends} == {
            url: name for name, urls in pods.items() for url in urls
        }
        picks = ((LARGE[0], "large"), (LARGE[1], "large"), (SMALL[0], "small"), ("", "large"))
        for model, pool in picks:
            for n in range(4):
                chunks = [
                    c
                    async for c in stub.Complete(
                        router_pb2.CompleteRequest(
                            input=f"merchant {n} asks about {model}", model=model, max_tokens=4
                        )
                    )
                ]
                assert chunks[0].backend in pods[pool], (model, chunks[0].backend)
            route = await stub.Route(router_pb2.RouteRequest(prompt="anything", model=model))
            assert route.pool == pool and route.backend in pods[pool]
        # The async client: the emulated pods answer on this test's event loop.
        async with openai.AsyncOpenAI(
            base_url=fleet.base + "/v1", api_key="k", max_retries=0
        ) as client:
            for model, pool in ((LARGE[1], "large"), (SMALL[0], "small")):
                answer = await client.completions.with_raw_response.create(
                    model=model, prompt=f"a prompt for {model}", max_tokens=4
                )
                assert answer.headers["x-prefix-sidecar-backend"] in pods[pool]
                chat = await client.chat.completions.with_raw_response.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
                assert chat.headers["x-prefix-sidecar-backend"] in pods[pool]
                streamed = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "hello there"}],
                    max_tokens=4,
                    stream=True,
                )
                assert "".join(
                    [c.choices[0].delta.content or "" async for c in streamed if c.choices]
                )
            listed = [m.id async for m in client.models.list()]
            assert listed[: len(LARGE)] == list(LARGE) and SMALL[0] in listed
        counts = await requests_per_pod(pods["large"] + pods["small"])
        assert sum(counts[url] for url in pods["small"]) == 4 + 3  # 4 gRPC, 3 HTTP
        async with aiohttp.ClientSession() as session, session.get(fleet.metrics) as scrape:
            text = await scrape.text()
        assert 'pool="small"' in text and 'pool="large"' in text
        assert 'prefix_sidecar_fleet_scale{pool="small"}' in text


async def test_an_unknown_model_is_not_found_and_names_the_served_ones(tmp_path: Path) -> None:
    async with (
        two_pools(tmp_path) as fleet,
        grpc.aio.insecure_channel(fleet.sidecar.target) as channel,
    ):
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Complete(router_pb2.CompleteRequest(input="x", model="gpt-5")):
                pass
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'gpt-5' is not served here" in (caught.value.details() or "")
        assert all(name in (caught.value.details() or "") for name in (*LARGE, *SMALL))
        with pytest.raises(grpc.aio.AioRpcError) as routed:
            await stub.Route(router_pb2.RouteRequest(prompt="x", model="gpt-5"))
        assert routed.value.code() == grpc.StatusCode.NOT_FOUND
        async with openai.AsyncOpenAI(
            base_url=fleet.base + "/v1", api_key="k", max_retries=0
        ) as client:
            for call in (
                lambda: client.completions.create(model="gpt-5", prompt="p", max_tokens=1),
                lambda: client.chat.completions.create(
                    model="gpt-5", messages=[{"role": "user", "content": "p"}]
                ),
            ):
                with pytest.raises(openai.NotFoundError) as missing:
                    await call()
                error = missing.value.body
                assert isinstance(error, dict) and error["code"] == "model_not_found"
                assert error["param"] == "model" and SMALL[0] in error["message"]
        # The sidecar keeps serving.
        ok = [c async for c in stub.Complete(router_pb2.CompleteRequest(input="y", model=SMALL[0]))]
        assert ok and ok[-1].finish_reason


async def test_prefixes_are_registered_per_pool(tmp_path: Path) -> None:
    async with (
        two_pools(tmp_path) as fleet,
        grpc.aio.insecure_channel(fleet.sidecar.target) as channel,
    ):
        stub = router_pb2_grpc.RouterStub(channel)
        pods = fleet.pods
        prefix = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name="rules", text=RULES, model=SMALL[0], prewarm=True)
        )
        assert prefix.pool == "small" and set(prefix.backends) <= set(pods["small"])
        assert [event.backend for event in prefix.prewarm if event.state == 2]
        listed = await stub.ListPrefixes(router_pb2.ListPrefixesRequest())
        assert [(p.name, p.pool) for p in listed.prefixes] == [("rules", "small")]
        chunks = [
            c
            async for c in stub.Complete(
                router_pb2.CompleteRequest(prefix_name="rules", input="q", model=SMALL[0])
            )
        ]
        assert chunks[0].backend in prefix.backends and chunks[-1].usage.cached_tokens > 0
        # The large pool has no prefix of that name.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Complete(
                router_pb2.CompleteRequest(prefix_name="rules", input="q", model=LARGE[0])
            ):
                pass
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        # A thin query over HTTP names the prefix in a header: the body's model picks the pool.
        async with aiohttp.ClientSession() as session:
            body = {"model": SMALL[0], "prompt": "q", "max_tokens": 2}
            async with session.post(
                fleet.base + "/v1/completions", json=body, headers={"x-prefix-name": "rules"}
            ) as reply:
                assert reply.status == 200, await reply.text()
                assert reply.headers["x-prefix-sidecar-backend"] in prefix.backends


@pytest.mark.parametrize(
    ("pools", "error"),
    [
        ([{"name": "a", "models": ["m"]}], "pool 'a' names no pods"),
        (
            [
                {"name": "a", "models": ["m"], "backends": ["http://127.0.0.1:1"]},
                {"name": "a", "models": ["n"], "backends": ["http://127.0.0.1:2"]},
            ],
            "duplicate pool names",
        ),
        (
            [
                {"name": "a", "models": ["m"], "backends": ["http://127.0.0.1:1"]},
                {"name": "b", "models": ["m"], "backends": ["http://127.0.0.1:2"]},
            ],
            "names model 'm' in pools 'a' and 'b'",
        ),
        ([{"name": "a", "models": [], "backends": ["http://127.0.0.1:1"]}], "non-empty list"),
        ([{"name": "a b", "models": ["m"], "backends": ["x"]}], "letters, digits"),
        ([{"name": "a", "models": ["m"], "backends": ["x"], "replicas": 2}], "unknown keys"),
        ([{"name": "a", "models": ["m"], "backends_dns": "x:1", "dns_interval_s": 0}], "(a): 'dns"),
    ],
)
def test_a_bad_pool_fails_at_start_naming_what_to_fix(pools: list[object], error: str) -> None:
    with pytest.raises(ConfigError, match=error.replace("(", r"\(").replace(")", r"\)")):
        build_config({"pools": pools})


def test_pools_and_top_level_backends_do_not_mix() -> None:
    with pytest.raises(ConfigError, match="'backends' is set at the top level, but pools is set"):
        build_config(
            {
                "backends": ["http://127.0.0.1:1"],
                "pools": [{"name": "a", "models": ["m"], "backends": ["http://127.0.0.1:2"]}],
            }
        )


async def test_a_pool_routes_as_a_sidecar_with_that_pool_alone(tmp_path: Path) -> None:
    """Routing contract 10: keys and picks do not depend on the pool. The same requests'
    Route answers from the two-pool process and from a one-pool sidecar of its pods."""
    prompts = [f"merchant {n} asks about the {n % 3}-for-1 offer. " * (40 + n) for n in range(12)]
    (tmp_path / "alone").mkdir()
    async with (
        two_pools(tmp_path) as fleet,
        grpc.aio.insecure_channel(fleet.sidecar.target) as channel,
        running_sidecar(sidecar_config(tmp_path / "alone", fleet.pods["small"])) as (_, alone),
    ):
        both = router_pb2_grpc.RouterStub(channel)
        for stub, model in ((both, SMALL[0]), (alone, "")):
            await stub.RegisterPrefix(
                router_pb2.RegisterPrefixRequest(name="rules", text=RULES, model=model)
            )
        for prompt in prompts:
            pooled = await both.Route(router_pb2.RouteRequest(prompt=prompt, model=SMALL[0]))
            single = await alone.Route(router_pb2.RouteRequest(prompt=prompt))
            assert (pooled.backend, pooled.route_key, list(pooled.preference)) == (
                single.backend,
                single.route_key,
                list(single.preference),
            )
        pooled = await both.Route(router_pb2.RouteRequest(prefix_name="rules", model=SMALL[0]))
        single = await alone.Route(router_pb2.RouteRequest(prefix_name="rules"))
        assert (pooled.backend, pooled.route_key) == (single.backend, single.route_key)
