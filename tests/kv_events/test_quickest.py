"""Precise routing counts the prefill queue it has built on a pod (membership/prefill_queues.py,
routing/precise.py to_quickest): emulated pods computing 2,000 prompt tokens a second, in
real time, publishing KV events."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from prefix_sidecar.kv_events.precise import PreciseRouting
from prefix_sidecar.routing.precise import DISCARD_BURST_TOKENS
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorConfig
from tests.kv_events.test_precise import PRECISE, TEXT, cached_elsewhere, precise_sidecar, send
from tests.server.conftest import wait_for
from tests.upstream.test_pod_faults import counted

SLOW = EmulatorConfig(block_size=16, kv_tokens=64 * 1024, kv_events="map", prefill_tps=2000.0)
# 2.2 s of prefill on a SLOW pod, and under the cap's floor (5,120 tokens): the holder takes it
TAIL = " tail" * 3500

# Real-time prefills on a shared machine: `make test` runs it alone.
pytestmark = pytest.mark.timing


async def test_a_busy_holder_loses_a_prompt_to_a_pod_whose_first_token_comes_sooner(
    tmp_path: Path,
) -> None:
    """The pod holding a prompt is computing a 4,400-token prompt this sidecar sent it (2.2 s):
    the next request for the prompt goes to the idle pod, which computes it in ~0.13 s
    (branch quickest). The sidecar learned the pods' speed from its first requests, and may
    discard the holder's cached tokens (its DiscardBudget is full)."""
    async with precise_sidecar(tmp_path, 2, SLOW) as (fleet, session, sidecar, stub):
        head = TEXT.format(n="quick")
        holder = await cached_elsewhere(sidecar, fleet.urls, session, head, chat=False)
        idle = next(url for url in fleet.urls if url != holder)
        queues = sidecar.pools.default.pool.queues
        for n, size in enumerate((50, 200, 400, 800)):  # four first tokens: the speed
            cold = router_pb2.CompleteRequest(input=f"{n} " + "warm up. " * size, max_tokens=1)
            await _backend(stub.Complete(cold, timeout=30))
        assert queues.rate.per_token_s > 2 * 1e-4  # 1 / 2,000 tokens/s, not the prior
        routing = sidecar.pools.default.router.precise
        assert isinstance(routing, PreciseRouting)
        assert routing.discards.tokens < len(head) // 4  # it has kept too little to discard
        routing.discards.tokens = DISCARD_BURST_TOKENS  # as after a long run of cached prompts

        long = router_pb2.CompleteRequest(input=head + TAIL, max_tokens=1)
        computing = asyncio.ensure_future(_backend(stub.Complete(long, timeout=30)))
        await wait_for(lambda: queues.backlog_tokens(fleet.urls)[holder] > 0, 5)
        assert await send("grpc-complete", stub, session, "", head) == idle
        assert counted(sidecar.metrics, PRECISE, outcome="quickest") == 1
        assert not computing.done()  # it was routed while the holder was busy

        assert await computing == holder  # the long one went to the prompt's holder
        assert queues.backlog_tokens(fleet.urls) == {holder: 0.0, idle: 0.0}
        await send("grpc-complete", stub, session, "", head)
        assert counted(sidecar.metrics, PRECISE, outcome="quickest") == 1  # no queue now


async def _backend(call: object) -> str:
    chunks = [chunk async for chunk in call]  # type: ignore[attr-defined]
    return str(chunks[0].backend)
