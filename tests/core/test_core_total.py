"""pick/pick_among with the loads' total given (routing contract section 4): the same answers
as summing, on the golden vectors and on random cases, over the ring and the Maglev table;
errors that name a broken invariant; and the cost that no longer grows with the fleet (a pick
whose home fits reads the home's loads and no other)."""

from __future__ import annotations

import random
from array import array
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

BIG = (1 << 63) - 2


def _ring(core: ModuleType, spec: dict[str, Any]) -> Any:
    return core.Ring(spec["members"], spec["weights"], spec["vnodes"])


def test_golden_picks_with_the_total_and_from_bytes(
    core: ModuleType, golden: dict[str, Any]
) -> None:
    rings = {spec["name"]: _ring(core, spec) for spec in golden["rings"]}
    for case in golden["picks"]:
        ring = rings[case["ring"]]
        expected = (case["member"], case["branch"])
        args = (case["replicas"], case["factor"], int(case["min_cap"]))
        total = sum(case["loads"])
        for loads in (list(case["loads"]), array("q", case["loads"])):
            assert ring.pick(int(case["key"]), loads, *args, total) == expected, case["why"]
            assert ring.pick(int(case["key"]), loads, *args, total=total) == expected
            got = ring.pick_bytes(case["key_of"].encode(), loads, *args, total=total)
            assert got == (*expected, int(case["key"])), case["why"]
            assert ring.pick_bytes(case["key_of"].encode(), loads, *args) == got
    for case in golden["picks_among"]:
        ring = rings[case["ring"]]
        loads = array("q", case["loads"])
        got = ring.pick_among(
            int(case["key"]), loads, case["homes"], case["factor"], int(case["min_cap"]),
            total=sum(case["loads"]),
        )  # fmt: skip
        assert got == (case["member"], case["branch"]), case["why"]


@pytest.mark.parametrize("kind", ["ring", "maglev"])
def test_random_cases_agree_with_and_without_the_total(core: ModuleType, kind: str) -> None:
    rng = random.Random(15)
    members = [f"http://10.1.0.{i}:8000" for i in range(23)]
    weights = [rng.randint(1, 3) for _ in members]
    table = core.make_table(kind, members, weights, 16)
    for _ in range(1500):
        top = rng.choice([1, 4, 30, 2**40])
        loads = array("q", [rng.randrange(0, top) for _ in members])
        key = rng.getrandbits(64)
        replicas = rng.randint(1, 5)
        factor = rng.choice([1.0, 1.25, 2.0])
        floor = rng.choice([0, 0, 3, 50])
        summed = table.pick(key, loads, replicas, factor, floor)
        assert table.pick(key, loads, replicas, factor, floor, sum(loads)) == summed
        homes = rng.sample(range(len(members)), rng.randint(1, 4))
        summed = table.pick_among(key, loads, homes, factor, floor)
        assert table.pick_among(key, loads, homes, factor, floor, sum(loads)) == summed


@settings(max_examples=150, deadline=None)
@given(
    count=st.integers(1, 12),
    loads=st.lists(st.integers(0, 2**50), min_size=12, max_size=12),
    key=st.integers(0, 2**64 - 1),
    replicas=st.integers(1, 4),
    factor=st.sampled_from([1.0, 1.25, 3.0, 1e20]),
    floor=st.integers(0, 2**53),
    kind=st.sampled_from(["ring", "maglev"]),
)
def test_the_twins_agree_with_the_total(
    twins: tuple[ModuleType, ModuleType],
    count: int,
    loads: list[int],
    key: int,
    replicas: int,
    factor: float,
    floor: int,
    kind: str,
) -> None:
    members = [f"m{i}" for i in range(count)]
    given_loads = array("q", loads[:count])
    total = sum(given_loads)
    answers = []
    for core in twins:
        table = core.make_table(kind, members, None, 8)
        answers.append(
            (
                table.pick(key, given_loads, replicas, factor, floor, total),
                table.pick(key, given_loads, replicas, factor, floor),
                table.pick_among(key, given_loads, [count - 1], factor, floor, total),
            )
        )
    assert answers[0] == answers[1]
    assert answers[0][0] == answers[0][1]


@pytest.mark.parametrize("kind", ["ring", "maglev"])
def test_a_fitting_home_reads_only_the_homes_loads(core: ModuleType, kind: str) -> None:
    """With the total given, pick touches the home set's loads alone: every other load here
    breaks the invariant (it is above the total) and would raise if it were read."""
    members = [f"http://10.2.0.{i}:8000" for i in range(200)]
    table = core.make_table(kind, members, None, 64)
    key = 12345678901234567
    home = [table.members.index(m) for m in table.preference(key, 3)]
    loads = array("q", [1 << 40] * len(members))
    for index in home:
        loads[index] = 1
    assert table.pick(key, loads, 3, 1.25, 4, total=3)[1] == "home"
    assert table.pick_among(key, loads, home[1:], 1.25, 4, total=3)[1] == "home"
    with pytest.raises(ValueError, match="above the given total 3; total must be sum"):
        table.pick(key, loads, 3, 1.25, 0, total=3)  # no floor: the home spills, reads more


def test_errors_for_a_given_total(core: ModuleType) -> None:
    ring = core.Ring(["a", "b", "c"], vnodes=4)
    loads = array("q", [1, 2, 3])
    with pytest.raises(TypeError, match="total must be an int"):
        ring.pick(1, loads, total=6.0)
    with pytest.raises(TypeError, match="total must be an int"):
        ring.pick(1, loads, total=True)
    with pytest.raises(ValueError, match="total is -1; it must be sum"):
        ring.pick(1, loads, total=-1)
    with pytest.raises(ValueError, match="total is 9223372036854775807"):
        ring.pick_among(1, loads, [0], total=BIG + 1)
    with pytest.raises(ValueError, match="loads has 2 entries for 3 members"):
        ring.pick(1, array("q", [1, 2]), total=3)
    with pytest.raises(ValueError, match="is negative"):
        ring.pick(1, array("q", [-1, -1, -1]), 3, total=0)
    with pytest.raises(TypeError, match="not str"):
        ring.pick(1, "abc", total=0)
    with pytest.raises(TypeError, match="route_key"):
        ring.pick_bytes("text", loads)
    # The checks come in the contract's order: R, c and the floor before the total.
    with pytest.raises(ValueError, match="replicas is 0"):
        ring.pick(1, loads, 0, total=-1)


def test_the_twins_raise_alike_for_a_broken_total(twins: tuple[ModuleType, ModuleType]) -> None:
    loads = array("q", [5, 0, 7, 1])
    messages = []
    for core in twins:
        ring = core.Ring(["a", "b", "c", "d"], vnodes=4)
        with pytest.raises(ValueError) as raised:
            ring.pick(3, loads, 4, 1.0, 0, total=2)
        messages.append(str(raised.value))
    assert messages[0] == messages[1] and "above the given total 2" in messages[0]
