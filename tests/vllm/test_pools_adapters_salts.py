"""Issue 30 on real vLLM pods: two pools of two tiny models behind one sidecar, a LoRA
adapter held by one pod of a pool, and cache salts. What counts is what vLLM reports: the
pod that answered and the usage's cached_tokens in its own events.

Pods: the package's two pods of the tiny model (pool "a"), two pods of a second tiny model
(the same tokenizer, other weights, served as "tiny-llama-b": pool "b"), and one more pod
of the first model holding the adapter "lora-a" (`--lora-modules`), five in all, started
once for the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest_asyncio

from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.harness import SidecarProcess, child_env
from prefix_sidecar_tools.vllm.fleet import VllmFleet, vllm_python
from prefix_sidecar_tools.vllm.models import MODEL_A, MODEL_B, ensure_adapter, ensure_model
from prefix_sidecar_tools.vllm.reports import cached_tokens
from prefix_sidecar_tools.vllm.tiny_model import document
from tests.vllm.conftest import VLLM_TESTS

pytestmark = VLLM_TESTS

ADAPTER = "lora-a"
QUERIES = 4  # thin queries per prefix: the first is cold under a new salt, the rest hit


@pytest_asyncio.fixture(scope="module", loop_scope="package")
async def more_pods() -> AsyncIterator[tuple[VllmFleet, VllmFleet]]:
    """Two pods of the second model and one pod of the first holding the adapter."""
    python = vllm_python()
    assert python is not None
    model = ensure_model(python, MODEL_A)
    adapter = ensure_adapter(python, model, ADAPTER)
    async with (
        VllmFleet(
            ensure_model(python, MODEL_B), 2, python=python, served_model=MODEL_B.served
        ) as fleet_b,
        VllmFleet(model, 1, python=python, lora_modules={ADAPTER: adapter}) as holder,
    ):
        yield fleet_b, holder


@contextlib.asynccontextmanager
async def sidecar(tmp_path: Path, name: str, config: dict[str, Any]) -> AsyncIterator[Any]:
    """`prefix-sidecar serve --config` with `config`; yields its gRPC Router stub."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps({"health_interval_s": 0.5, "first_token_timeout_s": 60, **config}))
    pods = sum(len(p["backends"]) for p in config.get("pools", [config]))
    process = SidecarProcess(
        str(tmp_path / f"{name}.sock"),
        ["--config", str(path)],
        log_path=str(tmp_path / f"{name}.log"),
        env=child_env(clean=True),
        start_timeout=30.0,
        backends_serving=pods,
    )
    async with process, grpc.aio.insecure_channel(process.target) as channel:
        yield router_pb2_grpc.RouterStub(channel)


async def complete(stub: Any, **fields: Any) -> tuple[str, int, int]:
    """Complete, greedy, with raw_events: (the pod, prompt_tokens, cached_tokens) as vLLM
    wrote them in its own last usage."""
    call = stub.Complete(
        router_pb2.CompleteRequest(max_tokens=2, temperature=0.0, raw_events=True, **fields),
        timeout=120,
    )
    chunks = [chunk async for chunk in call]
    events = [json.loads(event) for chunk in chunks for event in chunk.events]
    usage = [event["usage"] for event in events if event.get("usage")][-1]
    return chunks[0].backend, usage["prompt_tokens"], cached_tokens(usage)


async def thin_queries(stub: Any, model: str, prefix_id: str, salt: str) -> list[tuple[str, int]]:
    """QUERIES thin queries of a prefix: (pod, cached tokens) each."""
    served = []
    for n in range(QUERIES):
        pod, _, cached = await complete(
            stub, prefix_id=prefix_id, input=f" Question {n}?", model=model, cache_salt=salt
        )
        served.append((pod, cached))
    return served


async def test_two_pools_route_each_model_to_its_pods_as_a_sidecar_per_pool_would(
    fleet: VllmFleet, more_pods: tuple[VllmFleet, VllmFleet], tmp_path: Path
) -> None:
    fleet_b, _ = more_pods
    pools = {"a": (fleet.model, fleet.urls), "b": (MODEL_B.served, fleet_b.urls)}
    texts = {name: [document(f"pool-{name}-{n}", 1500) for n in range(2)] for name in pools}
    both = {
        "pools": [
            {"name": name, "models": [model], "backends": urls}
            for name, (model, urls) in pools.items()
        ]
    }

    async def run(stubs: dict[str, Any], salt: str) -> dict[str, list[tuple[str, int]]]:
        """Register each pool's prefixes (no prewarm) and send their thin queries under a
        new salt, so every pod starts cold for them."""
        served: dict[str, list[tuple[str, int]]] = {}
        for name, (model, _) in pools.items():
            served[name] = []
            for n, text in enumerate(texts[name]):
                prefix = await stubs[name].RegisterPrefix(
                    router_pb2.RegisterPrefixRequest(name=f"p{n}", text=text, model=model)
                )
                served[name] += await thin_queries(stubs[name], model, prefix.id, salt)
        return served

    async with sidecar(tmp_path, "both", both) as stub:
        together = await run({"a": stub, "b": stub}, "run-1")
        with_routes = {}
        for name, (model, _) in pools.items():
            route = await stub.Route(router_pb2.RouteRequest(prefix_name="p0", model=model))
            with_routes[name] = (route.pool, route.backend)
    async with (
        sidecar(tmp_path, "a", {"backends": fleet.urls, "model": fleet.model}) as stub_a,
        sidecar(tmp_path, "b", {"backends": fleet_b.urls, "model": MODEL_B.served}) as stub_b,
    ):
        apart = await run({"a": stub_a, "b": stub_b}, "run-2")
        alone = {
            "a": await stub_a.Route(router_pb2.RouteRequest(prefix_name="p0")),
            "b": await stub_b.Route(router_pb2.RouteRequest(prefix_name="p0")),
        }

    def hit(served: list[tuple[str, int]]) -> int:
        return sum(cached for _, cached in served)

    for name, (_, urls) in pools.items():
        print(f"\npool {name}: together {together[name]}\n        apart {apart[name]}")
        assert {pod for pod, _ in together[name]} <= set(urls), "a request left its pool"
        # Each prefix's queries meet on one pod, cold once, then cached.
        for n in range(2):
            queries = together[name][n * QUERIES : (n + 1) * QUERIES]
            assert len({pod for pod, _ in queries}) == 1 and queries[0][1] == 0
            assert all(cached >= 1024 for _, cached in queries[1:])
        assert hit(together[name]) == hit(apart[name])  # what one sidecar per pool gets
        assert with_routes[name] == (name, alone[name].backend)


async def test_an_adapters_requests_go_to_the_pod_that_holds_it(
    fleet: VllmFleet, more_pods: tuple[VllmFleet, VllmFleet], tmp_path: Path
) -> None:
    _, holder = more_pods
    urls = [*fleet.urls, *holder.urls]
    config = {"backends": urls, "model": fleet.model}
    async with sidecar(tmp_path, "lora", config) as stub:
        for _ in range(60):  # the adapter poll reaches every pod within a few seconds
            listed = await stub.ListBackends(router_pb2.ListBackendsRequest())
            if any(ADAPTER in b.adapters for b in listed.backends):
                break
            await asyncio.sleep(0.5)
        assert {b.url: list(b.adapters) for b in listed.backends} == {
            **{url: [] for url in fleet.urls},
            holder.urls[0]: [ADAPTER],
        }
        text = document("adapter-rules", 1500)
        prefix = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name="rules", text=text, model=ADAPTER, prewarm=True),
            timeout=120,
        )
        assert prefix.adapter == ADAPTER
        served = [
            await complete(stub, prefix_id=prefix.id, input=f" Q{n}?", model=ADAPTER)
            for n in range(10)
        ]
        prompts = [
            await complete(stub, input=document(f"adapter-prompt-{n}", 300), model=ADAPTER)
            for n in range(30)
        ]
        base = await complete(stub, prefix_id=prefix.id, input=" Q?", model=fleet.model)
    print(f"\nadapter, registered: {served}\nadapter, prompts: {prompts}\nbase: {base}")
    assert {pod for pod, _, _ in served + prompts} == {holder.urls[0]}
    # Prewarmed under the adapter: every query hits; the base model's cache is its own.
    assert all(cached >= 1024 for _, _, cached in served)
    assert base[2] == 0


async def test_two_salts_share_nothing_and_each_salts_turns_hit(
    fleet: VllmFleet, tmp_path: Path
) -> None:
    config = {"backends": fleet.urls, "model": fleet.model}
    text = document("salted-rules", 1500)
    async with sidecar(tmp_path, "salts", config) as stub:
        prefix = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="r", text=text))
        by_salt = {
            salt: await thin_queries(stub, fleet.model, prefix.id, salt)
            for salt in ("tenant-a", "tenant-b", "tenant-a-again")
        }
        again = await thin_queries(stub, fleet.model, prefix.id, "tenant-a")
    print(f"\n{by_salt}\nagain {again}")
    for served in by_salt.values():
        assert served[0][1] == 0, "no hit across salts: each salt's first query is cold"
        assert all(cached >= 1024 for _, cached in served[1:]), "a salt's own turns hit"
        assert len({pod for pod, _ in served}) == 1
    assert all(cached >= 1024 for _, cached in again)
