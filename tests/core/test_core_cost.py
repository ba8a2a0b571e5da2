"""A request's cost in the bounded-load pick (routing contract 4): member m fits when
load(m) + u <= max(min_cap, ceil(c (L + u) w / W)); u = 1 is the original pick. The golden
vectors of golden.json (rings and Maglev tables), vectors worked by hand below, the branch
boundaries, the bound as a property, and the errors, on both cores."""

from __future__ import annotations

from array import array
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_sidecar._core_py import cap
from tests.core.bounds import check_the_bound
from tests.core.golden_tables import golden_picks, maglev_from, ring_from

MEMBERS = ["http://a", "http://b", "http://c", "http://d"]
# key(b"golden-cost"); its preference order is a, c, d, b.
KEY = 9114371715941501276
# (loads a..d, R, min_cap, u) -> (member, branch); c = 1.25, four equal members.
VECTORS = [
    # cap = ceil(1.25 x 1 / 4) = 1: 0 + 1 <= 1.
    (([0, 0, 0, 0], 1, 0, 1), ("http://a", "home")),
    # cap = ceil(1.25 x 5 / 4) = 2: no member takes 5 on an empty fleet; the least loaded.
    (([0, 0, 0, 0], 1, 0, 5), ("http://a", "fallback")),
    # ... unless the floor admits it: 0 + 5 <= 8.
    (([0, 0, 0, 0], 1, 8, 5), ("http://a", "home")),
    # cap = ceil(1.25 x 4 / 4) = 2: a's 3 + 1 > 2; c's 0 + 1 <= 2.
    (([3, 0, 0, 0], 1, 0, 1), ("http://c", "spill")),
    # Homes a, c: c least; cap = ceil(1.25 x 600 / 4) = 188 < 200 for all: c, least loaded.
    (([300, 0, 0, 100], 2, 0, 200), ("http://c", "fallback")),
    # cap = ceil(1.25 x 550 / 4) = 172: a's 400 > 172, c's 100 <= 172.
    (([300, 50, 0, 100], 1, 0, 100), ("http://c", "spill")),
    # The floor in the same unit: 300 + 600 <= 1024.
    (([300, 50, 0, 100], 1, 1024, 600), ("http://a", "home")),
]


@pytest.mark.parametrize(("args", "expected"), VECTORS)
def test_the_cost_vectors_worked_by_hand(
    core: ModuleType, args: tuple[list[int], int, int, int], expected: tuple[str, str]
) -> None:
    ring = core.Ring(MEMBERS)
    assert core.route_key(b"golden-cost") == KEY
    assert ring.preference(KEY, 4) == ["http://a", "http://c", "http://d", "http://b"]
    loads, replicas, min_cap, cost = args
    assert ring.pick(KEY, loads, replicas, 1.25, min_cap, cost=cost) == expected
    assert ring.pick(KEY, loads, replicas, 1.25, min_cap, sum(loads), cost) == expected
    homes = [MEMBERS.index(m) for m in ring.preference(KEY, replicas)]
    assert ring.pick_among(KEY, loads, homes, 1.25, min_cap, cost=cost) == expected
    member, branch, key = ring.pick_bytes(b"golden-cost", loads, replicas, 1.25, min_cap, cost=cost)
    assert (member, branch, key) == (*expected, KEY)


def test_the_golden_cost_vectors(core: ModuleType, golden: dict[str, Any]) -> None:
    """golden.json's cost_picks, on the rings and the Maglev tables: pick, with the total and
    from bytes when the home set is the first R, pick_among when it is given."""
    tables = {spec["name"]: ring_from(core, spec) for spec in golden["rings"]}
    tables.update({spec["name"]: maglev_from(core, spec) for spec in golden["maglevs"]})
    cases = golden["cost_picks"]
    assert {"ring" in case for case in cases} == {True, False}, "rings and Maglev tables"
    assert any(case["cost"] > 1 and int(case["min_cap"]) > 0 for case in cases)
    for case, key, expected, min_cap in golden_picks(core, cases):
        table = tables[case.get("ring", case.get("table"))]
        factor, cost, total = case["factor"], case["cost"], sum(case["loads"])
        for loads in (list(case["loads"]), array("q", case["loads"])):
            if case["homes"] is None:
                replicas = case["replicas"]
                got = table.pick(key, loads, replicas, factor, min_cap, cost=cost)
                assert got == expected, case["why"]
                assert table.pick(key, loads, replicas, factor, min_cap, total, cost) == expected
                by_bytes = table.pick_bytes(
                    case["key_of"].encode(), loads, replicas, factor, min_cap, cost=cost
                )
                assert by_bytes == (*expected, key), case["why"]
            else:
                homes = case["homes"]
                got = table.pick_among(key, loads, homes, factor, min_cap, cost=cost)
                assert got == expected, case["why"]
                got = table.pick_among(key, loads, homes, factor, min_cap, total, cost)
                assert got == expected, case["why"]


def test_the_contract_document_shows_the_cost_vectors(golden: dict[str, Any]) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "routing-contract.md").read_text()
    names = {spec["name"]: f"ring {ab}" for spec, ab in zip(golden["rings"], "AB", strict=True)}
    names.update({s["name"]: f"Maglev {ab}" for s, ab in zip(golden["maglevs"], "AB", strict=True)})
    rows = [
        _cost_row(case, names[case.get("ring", case.get("table"))]) for case in golden["cost_picks"]
    ]
    missing = [row for row in rows if row not in doc]
    assert not missing, f"the cost table of docs/routing-contract.md lacks {missing}"


def _cost_row(case: dict[str, Any], table: str) -> str:
    """A cost vector as the contract document's table shows it (from the table to branch)."""
    host = case["member"].removeprefix("http://").rsplit(":", 1)[0]
    member = host.split(".")[0] if host.startswith("vllm-") else host
    key = f"`{case['key_of']}` (`{case['key']}`)"
    homes = "-" if case["homes"] is None else case["homes"]
    fields = [table, key, case["loads"], case["replicas"], homes, case["factor"]]
    fields += [case["min_cap"], case["cost"], member, case["branch"]]
    return "| " + " | ".join(map(str, fields)) + " |"


# --- the branch boundaries -----------------------------------------------------------------


def test_a_member_that_fits_one_request_but_not_five(core: ModuleType) -> None:
    """Every member at 3 of 15: cap ceil(1.25 x 16 / 4) = 5 admits 3 + 1; with u = 5 the cap
    is ceil(1.25 x 20 / 4) = 7 < 3 + 5, and the idle member (c) takes it."""
    ring = core.Ring(MEMBERS)
    assert ring.pick(KEY, [3, 3, 0, 3]) == ("http://a", "home")
    assert ring.pick(KEY, [3, 3, 0, 3], cost=5) == ("http://c", "spill")


def test_load_plus_cost_at_the_cap_fits_and_one_more_spills(core: ModuleType) -> None:
    """a holds x, the others 2,000 each, u = 640: a fits while x + 640 <=
    ceil(1.25 (6,000 + x + 640) / 4). At x = 2,088: 2,728 <= ceil(2,727.5); at x = 2,089:
    2,729 > ceil(2,727.8125) = 2,728, and c (2,000 + 640 <= 2,728) takes it."""
    ring = core.Ring(MEMBERS)
    for load, expected in ((2088, ("http://a", "home")), (2089, ("http://c", "spill"))):
        loads = [load, 2000, 2000, 2000]
        assert cap(1.25, sum(loads), 1, 4, 0, 640) == 2728
        assert ring.pick(KEY, loads, cost=640) == expected
        assert ring.pick(KEY, loads, 1, 1.25, 0, sum(loads), 640) == expected


def test_the_floor_still_wins(core: ModuleType) -> None:
    """The floor is in the load's unit: load + u <= min_cap fits whatever the proportional
    cap says, and one unit over it does not."""
    ring = core.Ring(MEMBERS)
    assert ring.pick(KEY, [900, 0, 0, 0], 1, 1.25, 1024, cost=124) == ("http://a", "home")
    assert ring.pick(KEY, [900, 0, 0, 0], 1, 1.25, 1024, cost=125) == ("http://c", "spill")
    # An idle fleet: the floor admits a request the proportional cap (ceil(1.25 x 900 / 4)
    # = 282) would not.
    assert ring.pick(KEY, [0, 0, 0, 0], 1, 1.25, 1024, cost=900) == ("http://a", "home")
    assert ring.pick(KEY, [0, 0, 0, 0], 1, 1.25, 0, cost=900) == ("http://a", "fallback")


def test_a_cost_over_every_cap_is_the_fallback(core: ModuleType) -> None:
    """No member fits: the least-loaded of all, ties to the earlier in the preference order
    (a, c, d, b), whatever the home set."""
    ring = core.Ring(MEMBERS)
    assert ring.pick(KEY, [5, 1, 1, 3], cost=16384) == ("http://c", "fallback")
    assert ring.pick(KEY, [5, 1, 1, 3], 4, 1.25, 8, cost=16384) == ("http://c", "fallback")
    assert ring.pick_among(KEY, [5, 1, 1, 3], [3, 0], cost=16384) == ("http://c", "fallback")
    assert ring.pick_bytes(b"golden-cost", [0, 0, 0, 0], cost=1 << 40)[:2] == (
        "http://a",
        "fallback",
    )


def test_a_cost_of_one_is_the_pick_without_one(core: ModuleType) -> None:
    ring = core.Ring(MEMBERS)
    for loads in ([0, 0, 0, 0], [3, 0, 0, 0], [9, 9, 1, 0], [5, 4, 3, 2]):
        assert ring.pick(KEY, loads, 2, 1.25, 2) == ring.pick(KEY, loads, 2, 1.25, 2, cost=1)


def test_cap_takes_the_cost_last() -> None:
    """The twin's cap(): existing positional calls keep their meaning; cost raises both the
    total the cap is a share of and, for the caller, what must fit under it."""
    assert cap(1.25, 15, 1, 4) == cap(1.25, 15, 1, 4, 0) == cap(1.25, 15, 1, 4, 0, 1) == 5
    assert cap(1.25, 15, 1, 4, 0, 5) == 7  # ceil(1.25 x 20 / 4)
    assert cap(1.25, 15, 1, 4, 1024, 5) == 1024  # the floor, as the int itself
    assert cap(1e300, 15, 1, 4, 0, 1 << 40) == float("inf")


# --- the bound, as a property --------------------------------------------------------------


@st.composite
def loaded_tables(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(1, 9))
    return {
        "kind": draw(st.sampled_from(["ring", "maglev"])),
        "members": [f"pod-{i}" for i in range(count)],
        "weights": draw(st.lists(st.integers(1, 5), min_size=count, max_size=count)),
        "key": draw(st.integers(0, (1 << 64) - 1)),
        "loads": draw(
            st.lists(
                st.one_of(st.integers(0, 12), st.integers(0, 50_000)),
                min_size=count,
                max_size=count,
            )
        ),
        "replicas": draw(st.integers(1, count + 1)),
        "factor": draw(st.one_of(st.sampled_from([1.0, 1.25, 2.0]), st.floats(1.0, 4.0))),
        "min_cap": draw(st.one_of(st.just(0), st.integers(0, 16), st.integers(0, 6000))),
        "cost": draw(st.one_of(st.just(1), st.integers(1, 16), st.integers(1, 20_000))),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=loaded_tables())
def test_bounded_load_with_a_cost(
    core: ModuleType, reference: ModuleType, case: dict[str, Any]
) -> None:
    """pick() never returns a member whose load + u is over its cap while another member's
    is within its own; "fallback" means no member fits, and is then the least loaded."""
    members, weights, loads = case["members"], case["weights"], case["loads"]
    table = core.make_table(case["kind"], members, weights, 8)
    key, replicas, factor = case["key"], case["replicas"], case["factor"]
    min_cap, cost = case["min_cap"], case["cost"]
    member, branch = table.pick(key, loads, replicas, factor, min_cap, cost=cost)
    total, total_weight = sum(loads), sum(weights)
    fits = {
        m: reference.fits(load, factor, total, w, total_weight, min_cap, cost)
        for m, load, w in zip(members, loads, weights, strict=True)
    }
    check_the_bound(table, key, replicas, loads, members, (member, branch), fits)
    if cost == 1:
        assert (member, branch) == table.pick(key, loads, replicas, factor, min_cap)


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cost", "error", "message"),
    [
        (0, ValueError, "a request's cost must be in 1.."),
        (-3, ValueError, "a request's cost must be in 1.."),
        ((1 << 40) + 1, ValueError, "a request's cost must be in 1.."),
        (1 << 64, ValueError, "a request's cost must be in 1.."),
        (True, TypeError, "cost must be an int >= 1"),
        (2.0, TypeError, "cost must be an int >= 1"),
        (None, TypeError, "cost must be an int >= 1"),
    ],
)
def test_a_bad_cost_says_what_to_fix(
    core: ModuleType, cost: object, error: type[Exception], message: str
) -> None:
    ring = core.Ring(MEMBERS)
    with pytest.raises(error, match=message):
        ring.pick(KEY, [0, 0, 0, 0], cost=cost)
    with pytest.raises(error, match=message):
        ring.pick_bytes(b"golden-cost", [0, 0, 0, 0], cost=cost)
    with pytest.raises(error, match=message):
        ring.pick_among(KEY, [0, 0, 0, 0], [1], cost=cost)


def test_the_cost_is_checked_after_the_other_parameters_and_before_the_key(
    core: ModuleType,
) -> None:
    ring = core.Ring(MEMBERS)
    with pytest.raises(ValueError, match="min_cap"):
        ring.pick(KEY, [0, 0, 0, 0], 1, 1.25, -1, cost=0)
    with pytest.raises(ValueError, match="cost"):
        ring.pick(-1, [0, 0, 0, 0], cost=0)
    with pytest.raises(ValueError, match="cost"):
        ring.pick_among(KEY, [0, 0, 0, 0], [], cost=0)


def test_the_total_and_the_cost_must_fit_in_int64(core: ModuleType) -> None:
    ring = core.Ring(MEMBERS)
    loads = [(1 << 62), (1 << 62) - 2, 0, 0]  # sum 2**63 - 2, the most a total may be
    assert ring.pick(KEY, loads, cost=1)[1] in ("home", "spill", "fallback")
    with pytest.raises(ValueError, match="plus the cost 2 is over 2\\*\\*63 - 1"):
        ring.pick(KEY, loads, cost=2)
    with pytest.raises(ValueError, match="plus the cost 2 is over 2\\*\\*63 - 1"):
        ring.pick(KEY, loads, 1, 1.25, 0, sum(loads), 2)
    with pytest.raises(ValueError, match="plus the cost 2 is over 2\\*\\*63 - 1"):
        ring.pick_among(KEY, loads, [0], cost=2)
    # The largest cost beside the largest total it leaves room for.
    loads = [(1 << 62), (1 << 62) - (1 << 40) - 1, 0, 0]
    assert ring.pick(KEY, loads, cost=1 << 40)[1] in ("home", "spill", "fallback")
