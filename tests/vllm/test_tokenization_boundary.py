"""The tokenization boundary (issue 28), measured on a real vLLM pod: a prefix prewarmed
alone, then the prefix + query text, as the sidecar sends them. Prints, per join and per
prewarm (the text as registered, which the sidecar sends, or the text without its trailing
whitespace), the query's cached_tokens against the prefix's whole blocks and against the
whole blocks of the prefix without its trailing whitespace (`kept`).

What the test holds:
- vLLM serves exactly the whole blocks that the prewarm's prompt and the query's share;
- no join with whitespace on either side costs a block that any prewarm of text could save:
  the sidecar's prewarm (the text as registered) serves every whole block of the prefix
  without its trailing whitespace. The block the table may still show `lost` holds that
  whitespace, which BPE merged into the query's first word: no text sent ahead of an
  unknown query can hold it;
- stripping the whitespace before the prewarm (the candidate fix) is never better on the
  same text, and a trailing newline that survives the join is a block it would lose;
- a query that starts with a space after a full stop (the shape the sidecar's callers
  send) loses nothing at all.
A query that continues the prefix's last word (`word | letters`) is printed, not asserted:
that is a different word, and no prewarm can know it.
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

WITH_WHITESPACE = [
    join for join, (ending, query) in JOINS.items() if ending.isspace() or query[0].isspace()
]


async def test_the_join_keeps_every_block_a_prewarm_of_text_can_keep(
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
    assert {case.warm for case in cases if case.aligned} == {"text", "stripped"}
    for case in cases:
        assert case.cached == whole_blocks(case.shared_tokens, case.block_size), case
    sent = [case for case in cases if case.warm == "text" and case.join in WITH_WHITESPACE]
    assert {case.join for case in sent if case.aligned} == set(WITH_WHITESPACE)
    assert [case for case in sent if case.blocks_short] == []
    # block-aligned prefixes, the same shape prewarmed both ways: the text as registered
    # never loses more; a newline that survives the join is a block only it keeps
    lost = {(c.join, c.warm): c.blocks_lost for c in cases if c.aligned}
    for join in JOINS:
        assert lost[join, "text"] <= lost[join, "stripped"], (join, lost)
    assert (lost["newline | newline", "text"], lost["newline | newline", "stripped"]) == (0, 1)
    assert all(case.blocks_lost == 0 for case in cases if case.join == "full stop | space")
    assert [rate.join for rate in rates] == list(JOINS)
    (after_full_stop,) = [rate for rate in rates if rate.join == "full stop | space"]
    assert after_full_stop.changed == 0
