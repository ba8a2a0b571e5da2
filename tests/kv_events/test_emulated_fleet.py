"""A sidecar with `kv_events=true` before emulated pods that publish KV events (three
processes, `--kv-events`): the emulator stands in for vLLM at fleet scale, so the residency,
routing on it and re-prewarm run here in seconds, in both encodings (tests/vllm has the
same flood on real vLLM pods)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import aiohttp
import pytest

from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet
from tests.kv_events.publisher import reprewarms
from tests.server.conftest import running_sidecar, sidecar_config, wait_for

BLOCK = 16
POD = EmulatorConfig(time_scale=1000.0, block_size=BLOCK, kv_tokens=64 * BLOCK)


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_a_flooded_home_is_known_routed_around_and_prewarmed_again(
    tmp_path: Path, encoding: str
) -> None:
    config = dataclasses.replace(POD, kv_events=encoding)
    async with EmulatorFleet(3, config) as fleet, aiohttp.ClientSession() as session:
        sidecar_settings = sidecar_config(tmp_path, fleet.urls, kv_events=True)
        async with running_sidecar(sidecar_settings) as (sidecar, stub):
            text = "rule: no coupon stacks with a flash discount. " * 24  # 1,128 B: 17 blocks
            request = router_pb2.RegisterPrefixRequest(
                name="rules", text=text, replicas=2, prewarm=True
            )
            registered = await stub.RegisterPrefix(request, timeout=30)
            homes = sidecar.router.home_set(sidecar.store.get(registered.id))
            await wait_for(lambda: sidecar.residency.resident(registered.id) == sorted(homes), 10)

            route = router_pb2.RouteRequest(prefix_id=registered.id)
            flooded = (await stub.Route(route)).backend
            for seed in range(8):  # straight to the pod: 64 blocks hold four of these
                body = {"model": POD.model, "prompt": f"flood {seed} " * 120, "max_tokens": 1}
                async with session.post(f"{flooded}/v1/completions", json=body) as answer:
                    assert answer.status == 200
            await wait_for(lambda: sidecar.residency.holds(flooded, registered.id) is False, 5)
            assert (await stub.Route(route)).backend != flooded  # the other home holds it
            await wait_for(lambda: reprewarms(sidecar, "evicted") == 1, 10, "a re-prewarm")
            await wait_for(lambda: sidecar.residency.holds(flooded, registered.id) is True, 10)
            assert (await stub.Route(route)).backend == flooded  # its hash pick again
