"""The fidelity trace (prefix_sidecar_tools.vllm.fidelity) on the emulator alone: its cache
outcomes follow LRU of blocks, as the trace is built to show, and a replay compared with
itself differs nowhere. tests/vllm/test_emulator_fidelity.py holds it against real vLLM."""

from __future__ import annotations

import aiohttp

from prefix_sidecar_tools.emulator import run_emulator
from prefix_sidecar_tools.vllm.fidelity import BLOCK_SIZE, compare, emulator_config
from prefix_sidecar_tools.vllm.fidelity_trace import build_trace, observe

# 84 blocks: three of the trace's prefixes (22 blocks each at 4 bytes a token), not four.
KV_TOKENS = 84 * BLOCK_SIZE
EXPECTED = (
    "cold full cold full cold full cold full full cold full "  # everything fits
    "cold full partial none partial partial partial"  # D evicts B's tail, then S1, ...
)


async def test_the_trace_evicts_least_recently_used_blocks_first() -> None:
    trace = build_trace("unit")
    async with (
        run_emulator(emulator_config(KV_TOKENS, "m")) as first,
        run_emulator(emulator_config(KV_TOKENS, "m")) as second,
        aiohttp.ClientSession() as session,
    ):
        one = await observe(session, first, "m", trace, BLOCK_SIZE)
        other = await observe(session, second, "m", trace, BLOCK_SIZE)
    assert " ".join(reply.outcome for reply in one.replies) == EXPECTED
    assert all(reply.cached % BLOCK_SIZE == 0 for reply in one.replies)
    rows = {row.what: row for row in compare(trace, one, other, BLOCK_SIZE)}
    assert rows["eviction order"].vllm == "B S1 C A D"
    assert [row.what for row in rows.values() if not row.same] == []
