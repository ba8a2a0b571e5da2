"""RegisterPrefix with prewarm answers once the placement has settled: a registration that
moves an earlier prefix's home (the KV budget, first-fit decreasing) warms it there before
the answer. Traffic sent on WARMED then finds every prefix on its home; before, the move
was warmed in the background while the first requests arrived (`bench real --engine vllm
--workloads registered`: "placement moved" seconds after the last WARMED, TTFT p99 2-5 s)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from prefix_sidecar import _core
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator
from tests.server.conftest import (
    FAST,
    cached_tokens,
    owner_ring,
    running_sidecar,
    sidecar_config,
)

SMALL, LARGE = 2_000, 3_000  # tokens (4 bytes each in the emulator's count)
BUDGET = 3_000  # the large prefix fits alone; both do not
# A prefill of SMALL tokens takes ~0.5 s here: the moved prefix's prewarm outlasts the
# large one's on the fast pod, so an answer that did not wait for it comes first.
SLOW = EmulatorConfig(prefill_tps=4_000.0)


def same_home_texts(ring: _core.Ring, home: str) -> tuple[str, str]:
    """A small and a large prefix that the plain ring both homes on `home`."""
    found: dict[int, str] = {}
    for salt in range(400):
        for tokens in (SMALL, LARGE):
            text = f"rules {salt}-{tokens} ".ljust(4 * tokens, "z")
            if tokens not in found and ring.owner(_core.prefix_route_key(text)) == home:
                found[tokens] = text
        if len(found) == 2:
            return found[SMALL], found[LARGE]
    raise AssertionError("no two prefixes on one home")


async def test_a_registration_that_moves_a_home_warms_it_before_answering(
    tmp_path: Path,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        fast = await stack.enter_async_context(run_emulator(FAST, port=0))
        slow = await stack.enter_async_context(run_emulator(SLOW, port=0))
        small, large = same_home_texts(owner_ring([fast, slow]), fast)
        config = sidecar_config(tmp_path, [fast, slow], home_kv_budget_tokens=BUDGET)
        sidecar, stub = await stack.enter_async_context(running_sidecar(config))
        first = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name="small", text=small, prewarm=True)
        )
        assert list(first.backends) == [fast]

        second = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name="large", text=large, prewarm=True)
        )
        assert list(second.backends) == [fast]
        assert [e.state for e in second.prewarm] == [router_pb2.PrewarmEvent.WARMED]
        pool = sidecar.pools.default
        moved = pool.router.home_set(pool.store.get(first.id))
        assert moved == [slow]  # the large prefix took the fast pod's whole budget
        # At the answer, not eventually: the moved prefix is warm on its new home.
        assert first.id in pool.pool.backends[slow].warm_prefixes
        assert await cached_tokens(slow, small) >= SMALL - 128
