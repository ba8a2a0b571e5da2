"""Bad input gets a ValueError/TypeError whose message names the problem - never a crash, a
hang, or a silently wrong answer - in both twins."""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

Case = tuple[str, Callable[[ModuleType], Any], type[Exception], str]


def _ring(core: ModuleType) -> Any:
    return core.Ring(["a", "b", "c"], vnodes=4)


CASES: list[Case] = [
    ("empty members", lambda c: c.Ring([]), ValueError, "empty"),
    ("members is a str", lambda c: c.Ring("abc"), TypeError, "single string"),
    ("member not a str", lambda c: c.Ring(["a", 5]), TypeError, "member 1 must be a str"),
    ("member empty string", lambda c: c.Ring(["a", ""]), ValueError, "empty string"),
    ("duplicate members", lambda c: c.Ring(["a", "b", "a"]), ValueError, "duplicate member 'a'"),
    ("member lone surrogate", lambda c: c.Ring(["a\ud800"], vnodes=1), ValueError, "surrogate"),
    ("weight 0", lambda c: c.Ring(["a", "b"], [1, 0]), ValueError, "weight of 'b' is 0"),
    ("weight negative", lambda c: c.Ring(["a", "b"], [-2, 1]), ValueError, "weight of 'a' is -2"),
    ("weight float", lambda c: c.Ring(["a"], [1.5]), TypeError, "weight of 'a' must be an int"),
    ("weight bool", lambda c: c.Ring(["a"], [True]), TypeError, "weight of 'a' must be an int"),
    ("weights too few", lambda c: c.Ring(["a", "b"], [1]), ValueError, "1 weights for 2 members"),
    ("vnodes 0", lambda c: c.Ring(["a"], vnodes=0), ValueError, "vnodes is 0"),
    ("vnodes str", lambda c: c.Ring(["a"], vnodes="8"), TypeError, "vnodes must be an int"),
    ("too many points", lambda c: c.Ring(["a"], vnodes=1 << 30), ValueError, "points exceeds"),
    ("key str", lambda c: _ring(c).owner("12"), TypeError, "key must be an int"),
    ("key float", lambda c: _ring(c).owner(1.0), TypeError, "key must be an int"),
    ("key bool", lambda c: _ring(c).owner(True), TypeError, "key must be an int"),
    ("key None", lambda c: _ring(c).preference(None, 2), TypeError, "key must be an int"),
    ("key negative", lambda c: _ring(c).owner(-1), ValueError, "out of range"),
    ("key 2**64", lambda c: _ring(c).owner(1 << 64), ValueError, "out of range"),
    ("pick key 2**64", lambda c: _ring(c).pick(1 << 64, [0, 0, 0]), ValueError, "out of range"),
    ("preference n 0", lambda c: _ring(c).preference(1, 0), ValueError, "n is 0"),
    ("preference n float", lambda c: _ring(c).preference(1, 2.0), TypeError, "n must be an int"),
    ("loads too short", lambda c: _ring(c).pick(1, [0, 0]), ValueError, "loads has 2 entries"),
    ("loads too long", lambda c: _ring(c).pick(1, [0] * 4), ValueError, "loads has 4 entries"),
    ("load negative", lambda c: _ring(c).pick(1, [0, -1, 0]), ValueError, "load -1 is negative"),
    ("load float", lambda c: _ring(c).pick(1, [0, 1.5, 0]), TypeError, "integer"),
    ("load str", lambda c: _ring(c).pick(1, [0, "1", 0]), TypeError, "'str' object cannot"),
    ("loads bytes", lambda c: _ring(c).pick(1, b"\0" * 24), TypeError, "not bytes"),
    ("loads None", lambda c: _ring(c).pick(1, None), TypeError, "not iterable"),
    ("load >= 2**63", lambda c: _ring(c).pick(1, [0, 1 << 63, 0]), ValueError, "64-bit"),
    ("loads overflow", lambda c: _ring(c).pick(1, [1 << 62] * 3), ValueError, "loads sum to"),
    ("replicas 0", lambda c: _ring(c).pick(1, [0, 0, 0], 0), ValueError, "replicas is 0"),
    ("replicas float", lambda c: _ring(c).pick(1, [0, 0, 0], 1.0), TypeError, "replicas must"),
    ("factor < 1", lambda c: _ring(c).pick(1, [0, 0, 0], 1, 0.5), ValueError, "factor is 0.5"),
    ("factor NaN", lambda c: _ring(c).pick(1, [0, 0, 0], 1, float("nan")), ValueError, "factor"),
    ("factor inf", lambda c: _ring(c).pick(1, [0, 0, 0], 1, float("inf")), ValueError, "finite"),
    ("factor str", lambda c: _ring(c).pick(1, [0, 0, 0], 1, "1.25"), TypeError, "factor must"),
    ("min_cap -1", lambda c: _ring(c).pick(1, [0, 0, 0], 1, 1.25, -1), ValueError, "min_cap is -1"),
    (
        "min_cap float",
        lambda c: _ring(c).pick(1, [0, 0, 0], min_cap=8.0),
        TypeError,
        "min_cap must",
    ),
    (
        "min_cap bool",
        lambda c: _ring(c).pick(1, [0, 0, 0], min_cap=True),
        TypeError,
        "min_cap must",
    ),
    ("min_cap str", lambda c: _ring(c).pick(1, [0, 0, 0], min_cap="8"), TypeError, "min_cap must"),
    (
        "min_cap None",
        lambda c: _ring(c).pick(1, [0, 0, 0], min_cap=None),
        TypeError,
        "got NoneType",
    ),
    (
        "replicas checked before min_cap",
        lambda c: _ring(c).pick(1, [0, 0, 0], 0, 1.25, -1),
        ValueError,
        "replicas is 0",
    ),
    (
        "min_cap checked before the loads",
        lambda c: _ring(c).pick(1, [0, -1, 0], min_cap=-2),
        ValueError,
        "min_cap is -2",
    ),
    ("homes empty", lambda c: _ring(c).pick_among(1, [0, 0, 0], []), ValueError, "homes is empty"),
    ("homes None", lambda c: _ring(c).pick_among(1, [0, 0, 0], None), TypeError, "member indexes"),
    ("homes str", lambda c: _ring(c).pick_among(1, [0, 0, 0], "ab"), TypeError, "not str"),
    ("home 3 of 3", lambda c: _ring(c).pick_among(1, [0, 0, 0], [3]), ValueError, "index 3"),
    ("home -1", lambda c: _ring(c).pick_among(1, [0, 0, 0], [0, -1]), ValueError, "index -1"),
    ("home twice", lambda c: _ring(c).pick_among(1, [0, 0, 0], [1, 1]), ValueError, "twice"),
    ("home name", lambda c: _ring(c).pick_among(1, [0, 0, 0], ["a"]), TypeError, "holds a str"),
    ("home bool", lambda c: _ring(c).pick_among(1, [0, 0, 0], [True]), TypeError, "holds a bool"),
    (
        "homes checked before the key",
        lambda c: _ring(c).pick_among(-1, [0, 0, 0], []),
        ValueError,
        "homes is empty",
    ),
    (
        "factor checked before homes",
        lambda c: _ring(c).pick_among(1, [0, 0, 0], [], 0.5),
        ValueError,
        "factor is 0.5",
    ),
    (
        "pick_among loads too short",
        lambda c: _ring(c).pick_among(1, [0, 0], [0]),
        ValueError,
        "loads has 2 entries",
    ),
    ("route_key str", lambda c: c.route_key("text"), TypeError, "needs bytes, got str"),
    ("route_key None", lambda c: c.route_key(None), TypeError, "needs bytes"),
    ("route_key int", lambda c: c.route_key(5), TypeError, "needs bytes"),
    ("prefix_id bytes", lambda c: c.prefix_id(b"x"), TypeError, "needs str"),
    ("prefix_id surrogate", lambda c: c.prefix_id("ok\udc80"), ValueError, "lone surrogate"),
    ("prefix_route_key surrogate", lambda c: c.prefix_route_key("\ud800"), ValueError, "surrogate"),
    ("chain_keys str", lambda c: c.chain_keys("text", 64, 8), TypeError, "encode text as UTF-8"),
    ("chain_keys block 0", lambda c: c.chain_keys(b"x", 0, 8), ValueError, "block_bytes is 0"),
    ("chain_keys block huge", lambda c: c.chain_keys(b"x", 1 << 17, 8), ValueError, "1..65536"),
    ("chain_keys block bool", lambda c: c.chain_keys(b"x", True, 8), TypeError, "block_bytes"),
    ("chain_keys negative", lambda c: c.chain_keys(b"x", 64, -1), ValueError, "max_blocks is -1"),
    ("chain_keys float", lambda c: c.chain_keys(b"x", 64, 1.0), TypeError, "max_blocks must"),
    ("session_home 0", lambda c: _ring(c).session_home(1, 0, 2), ValueError, "homes is 0"),
    ("session_home str", lambda c: _ring(c).session_home(1, "2", 2), TypeError, "homes must"),
    ("session_home key", lambda c: _ring(c).session_home(-1, 1, 2), ValueError, "out of range"),
    ("session_home session", lambda c: _ring(c).session_home(1, 1, 2.0), TypeError, "key must"),
]


@pytest.mark.parametrize(("name", "call", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_by_name(
    core: ModuleType,
    name: str,
    call: Callable[[ModuleType], Any],
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call(core)


def test_a_floor_of_any_size_is_accepted(core: ModuleType) -> None:
    """min_cap has no upper bound: above every possible load it admits the owner."""
    ring = _ring(core)
    owner = ring.owner(1)
    loads = [(1 << 61) if m == owner else 0 for m in ring.members]
    assert ring.pick(1, loads, 1, 1.0)[1] == "spill"
    for floor in ((1 << 61) + 1, (1 << 63) - 1, 1 << 63, 1 << 200):
        assert ring.pick(1, loads, 1, 1.0, floor) == (owner, "home")
    assert ring.pick(1, loads, 1, 1.0, 1 << 61)[1] == "spill"  # load + 1 is one above it


def test_a_refused_call_leaves_the_ring_usable(core: ModuleType) -> None:
    ring = _ring(core)
    expected = ring.pick(42, [0, 0, 0])
    for bad in ([0, -1, 0], [1 << 62] * 3, [0, 0]):
        with pytest.raises(ValueError):
            ring.pick(42, bad)
    assert ring.pick(42, [0, 0, 0]) == expected


BIG = (1 << 62) - 1
LOADS_CASES = [
    ([BIG, BIG, 0], None),  # 2**63 - 2: the most the loads may sum to
    ([BIG, BIG, 1], "the loads sum to more than"),
    ([BIG, BIG + 1, 0], "the loads sum to more than"),
    ([((1 << 31) - 1) << 32, (1 << 32) - 2, 0], None),  # high halves at their most
    ([((1 << 31) - 1) << 32, (1 << 32) - 1, 0], "the loads sum to more than"),
    ([(1 << 32) - 1] * 3, None),  # low halves that carry into the high ones
    ([5, -5, 0], "load -5 is negative"),  # a sum that looks fine
    ([-1, 1 << 62, 1 << 62], "load -1 is negative"),  # the first broken rule, in member order
    ([1 << 62, 1 << 62, -1], "the loads sum to more than"),
    ([-(1 << 63), 0, 0], f"load {-(1 << 63)} is negative"),
]


@pytest.mark.parametrize(("loads", "message"), LOADS_CASES)
def test_the_loads_are_summed_and_checked_in_member_order(
    core: ModuleType, loads: list[int], message: str | None
) -> None:
    """Summing refuses a negative load or a sum past 2**63 - 2, whichever comes first along
    the members (the extension sums without a branch per load and walks again to find it)."""
    ring = _ring(core)
    for given in (loads, array("q", loads)):
        if message is None:
            assert ring.pick(42, given)[1] in ("home", "spill", "fallback")
        else:
            with pytest.raises(ValueError, match=re.escape(message)):
                ring.pick(42, given)
