"""Adapters at fleet scale (issue 30's target): six emulated pod processes holding LoRA
adapters as vLLM does (loaded at run time through /v1/load_lora_adapter), one sidecar that
learns who holds what from the pods' /v1/models, and concurrent traffic through the HTTP
front for two adapters and the base model. Every adapter request must reach a pod holding
its adapter (a pod without it answers vLLM's 404), while the load stays bounded."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from pathlib import Path

import aiohttp

from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet
from prefix_sidecar_tools.harness import free_port
from tests.server.conftest import running_sidecar, sidecar_config, wait_for

BASE = "tiny-llama"
# A tenth of real time: a request takes tens of ms, so dozens overlap on six pods.
PODS = EmulatorConfig(model=BASE, time_scale=10.0, enable_lora=True, runtime_lora_updating=True)
HOLDERS = {"lora-a": (0, 1), "lora-b": (2, 3, 4)}  # pod 5 holds none
REQUESTS, CONCURRENCY = 240, 24


async def load_adapters(session: aiohttp.ClientSession, urls: list[str]) -> None:
    for name, pods in HOLDERS.items():
        for i in pods:
            body = {"lora_name": name, "lora_path": f"/adapters/{name}"}
            async with session.post(urls[i] + "/v1/load_lora_adapter", json=body) as reply:
                assert reply.status == 200, await reply.text()


def prompt(n: int) -> str:
    """Twelve tenants' system prompts (past the 4 KB window: organic keys) and a question."""
    return f"Tenant {n % 12} rules: keep claims honest. " * 120 + f"Question {n}?"


async def test_every_adapter_request_reaches_a_pod_that_holds_it(tmp_path: Path) -> None:
    async with (
        EmulatorFleet(6, dataclasses.replace(PODS)) as fleet,
        aiohttp.ClientSession() as session,
    ):
        await load_adapters(session, fleet.urls)
        port = free_port()
        config = sidecar_config(tmp_path, fleet.urls, model=BASE, openai_listen=f"127.0.0.1:{port}")
        async with running_sidecar(config) as (_, stub):

            async def learnt() -> bool:
                listed = await stub.ListBackends(router_pb2.ListBackendsRequest())
                return sum(len(b.adapters) for b in listed.backends) == 5

            await wait_for(learnt, timeout=15.0, what="the pods' adapters learnt")
            gate = asyncio.Semaphore(CONCURRENCY)

            async def send(n: int) -> tuple[str, str, int]:
                model = ("lora-a", "lora-b", BASE)[n % 3]
                body = {"model": model, "prompt": prompt(n), "max_tokens": 8}
                async with (
                    gate,
                    session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as reply,
                ):
                    await reply.read()
                    return model, reply.headers.get("x-prefix-sidecar-backend", ""), reply.status

            served = await asyncio.gather(*(send(n) for n in range(REQUESTS)))

    holders = {name: {fleet.urls[i] for i in pods} for name, pods in HOLDERS.items()}
    statuses = Counter(status for _, _, status in served)
    on_holder = [pod in holders[model] for model, pod, _ in served if model in holders]
    per_pod = Counter(pod for _, pod, _ in served)
    print(
        f"\nadapter requests on a holder: {sum(on_holder)}/{len(on_holder)}; "
        f"statuses {dict(statuses)}; per pod {[per_pod[url] for url in fleet.urls]}"
    )
    assert statuses == {200: REQUESTS}, "a pod without the adapter answers 404"
    assert sum(on_holder) == len(on_holder) == 160
    # The base model's requests spread over the fleet, the pod without adapters included.
    assert per_pod[fleet.urls[5]] > 0
