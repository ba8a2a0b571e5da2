"""A sidecar with `kv_events=true` before emulated pods that publish KV events (three
processes, `--kv-events`): the emulator stands in for vLLM at fleet scale, so the residency,
routing on it and re-prewarm run here in seconds, in both encodings (tests/vllm has the
same flood on real vLLM pods)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import aiohttp
import pytest

from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet
from tests.kv_events.publisher import reprewarms, resident_gauge
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
            homes = sidecar.pools.default.router.home_set(
                sidecar.pools.default.store.get(registered.id)
            )
            await wait_for(
                lambda: sidecar.pools.default.residency.resident(registered.id) == sorted(homes), 10
            )

            route = router_pb2.RouteRequest(prefix_id=registered.id)
            flooded = (await stub.Route(route)).backend
            for seed in range(8):  # straight to the pod: 64 blocks hold four of these
                body = {"model": POD.model, "prompt": f"flood {seed} " * 120, "max_tokens": 1}
                async with session.post(f"{flooded}/v1/completions", json=body) as answer:
                    assert answer.status == 200
            await wait_for(
                lambda: sidecar.pools.default.residency.holds(flooded, registered.id) is False, 5
            )
            assert (await stub.Route(route)).backend != flooded  # the other home holds it
            await wait_for(lambda: reprewarms(sidecar, "evicted") == 1, 10, "a re-prewarm")
            await wait_for(
                lambda: sidecar.pools.default.residency.holds(flooded, registered.id) is True, 10
            )
            assert (await stub.Route(route)).backend == flooded  # its hash pick again


async def test_a_pod_too_small_for_its_prefixes_is_not_refilled_into_a_storm(
    tmp_path: Path,
) -> None:
    """One pod whose cache holds one of its two prefixes, and traffic for both straight
    to it: each request evicts the other prefix, so re-prewarms would thrash it further.
    None goes out: the lost prefix does not fit beside the one the pod holds, and that is
    counted as no_room, once per prefix and pod per reprewarm_interval_s. The resident
    gauge says what the pod holds."""
    interval, watched = 4.0, 10.0
    config = dataclasses.replace(POD, kv_events="map", kv_tokens=24 * BLOCK)
    texts = {name: f"{name}: the rules of the sale. " * 36 for name in "ab"}  # 16 blocks of 24
    async with EmulatorFleet(1, config) as fleet, aiohttp.ClientSession() as session:
        pod = fleet.urls[0]
        settings = sidecar_config(
            tmp_path, fleet.urls, kv_events=True, reprewarm_interval_s=interval
        )
        async with running_sidecar(settings) as (sidecar, stub):
            for name, text in texts.items():
                request = router_pb2.RegisterPrefixRequest(name=name, text=text, prewarm=True)
                await stub.RegisterPrefix(request, timeout=30)
            loop = asyncio.get_running_loop()
            started = loop.time()
            sent_before = reprewarms(sidecar, "evicted")
            gauge = set()
            while loop.time() - started < watched:
                for text in texts.values():
                    body = {"model": POD.model, "prompt": text + " Q?", "max_tokens": 1}
                    async with session.post(f"{pod}/v1/completions", json=body) as answer:
                        assert answer.status == 200
                    gauge.add(resident_gauge(sidecar, pod))
                    await asyncio.sleep(1.3)  # slower than the 1 s checks, not in step
            elapsed = loop.time() - started
            sent = reprewarms(sidecar, "evicted") - sent_before
            no_room = reprewarms(sidecar, "no_room")
    print(f"\n{sent:.0f} re-prewarms, {no_room:.0f} without room in {elapsed:.1f} s")
    assert gauge <= {None, 0.0, 1.0} and 1.0 in gauge  # never both: they do not fit
    # Two prefixes on one pod, each lost at every other request: said at most once per
    # prefix and interval (6 in 10 s at 4 s), and at least once for each.
    assert sent == 0 and 2 <= no_room <= 2 * (elapsed // interval + 1), (sent, no_room)
