"""What a request weighs (routing/cost.py): the estimates and the spill that would compute a
prefix, which waits on a warm home instead while that weighs less."""

from __future__ import annotations

import array

from prefix_sidecar import _core
from prefix_sidecar.routing.cost import (
    DECODE_TOKENS,
    LATER_TURN_TOKENS,
    floor_units,
    organic_prefill,
    pick_cost,
    stay_warm,
    tokens_of,
)
from prefix_sidecar.routing.organic import OrganicKeys
from prefix_sidecar.routing.pick import Branch
from prefix_sidecar.routing.table import RoutingTable

from .conftest import pods


def table(urls: list[str], loads: list[int]) -> RoutingTable:
    ring = _core.Ring(urls)
    index = {url: i for i, url in enumerate(ring.members)}
    values = array.array("q", (loads[urls.index(m)] for m in ring.members))
    return RoutingTable(ring, index, values, 1, sum(values))


def test_the_estimates() -> None:
    assert tokens_of(4000) == 1000 and tokens_of(0) == 0 and tokens_of(-5) == 0
    assert pick_cost("requests", 16_000) == 1
    assert pick_cost("tokens", 16_000) == 16_000 + DECODE_TOKENS
    assert floor_units("requests", 8) == 8 and floor_units("tokens", 8) == 8 * DECODE_TOKENS
    unanchored = OrganicKeys(family=1, session=2, share=0.1, anchor=-1)
    later = unanchored._replace(anchor=3)
    start = later._replace(start=True, head=4000)
    assert organic_prefill(unanchored, 5000) == 5000
    assert organic_prefill(later, 5000) == LATER_TURN_TOKENS
    assert organic_prefill(start, 5000) == 4000  # past its family's 1,000-token head


def test_a_spill_that_would_compute_the_prefix_waits_on_the_least_loaded_home() -> None:
    home_a, home_b, far, warm_far = pods(4)
    homes = (home_a, home_b)
    snapshot = table(pods(4), [9_000, 7_000, 1_000, 1_000])
    holds = {warm_far}.__contains__
    # The far pod would compute 60k tokens: waiting behind home b's 7k weighs less.
    assert stay_warm(snapshot, homes, far, Branch.SPILL, 60_000, holds) == (home_b, Branch.STAYED)
    # A small prefix costs less to compute than to wait for: the spill stands.
    assert stay_warm(snapshot, homes, far, Branch.SPILL, 2_000, holds) == (far, Branch.SPILL)
    # A pod that holds the prefix is no cold spill.
    assert stay_warm(snapshot, homes, warm_far, Branch.SPILL, 60_000, holds) == (
        warm_far,
        Branch.SPILL,
    )
