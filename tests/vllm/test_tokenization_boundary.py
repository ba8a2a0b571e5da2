"""The tokenization boundary (issue 28), measured on a real vLLM pod: a prefix prewarmed
alone, then the prefix + query text, as the sidecar sends them. Prints, per join, the
query's cached_tokens against floor(prefix tokens / block size) x block size.

What the test holds: vLLM serves exactly the whole blocks the two tokenizations share, and
a query that starts with a space after a prefix ending in a full stop (the shape the
sidecar's callers send) loses nothing. Whether other joins lose a block is printed, not
asserted: that is the measurement.
"""

from __future__ import annotations

import aiohttp

from prefix_sidecar_tools.vllm.boundary import (
    HEADER,
    JOINS,
    RATE_HEADER,
    join_rates,
    measure_joins,
)
from prefix_sidecar_tools.vllm.fleet import VllmFleet
from prefix_sidecar_tools.vllm.reports import whole_blocks
from tests.vllm.conftest import VLLM_TESTS

pytestmark = VLLM_TESTS


async def test_the_join_keeps_the_whole_blocks_both_tokenizations_share(
    fleet: VllmFleet, session: aiohttp.ClientSession
) -> None:
    cases = await measure_joins(session, fleet.urls[-1], fleet.model)
    rates = await join_rates(session, fleet.urls[-1], fleet.model)
    print("\n" + HEADER)
    for case in cases:
        print(case.row())
    print("\n" + RATE_HEADER)
    for rate in rates:
        print(rate.row())

    assert {case.join for case in cases} == set(JOINS)
    assert any(case.aligned for case in cases), "no block-aligned prefix was found"
    for case in cases:
        assert case.cached == whole_blocks(case.shared_tokens, case.block_size), case
    assert all(case.blocks_lost == 0 for case in cases if case.join == "full stop | space")
    assert [rate.join for rate in rates] == list(JOINS)
    (after_full_stop,) = [rate for rate in rates if rate.join == "full stop | space"]
    assert after_full_stop.changed == 0
