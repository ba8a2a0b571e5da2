"""A request's cost in the bounded-load pick (routing contract 4): member m fits when
load(m) + u <= max(min_cap, ceil(c (L + u) w / W)); u = 1 is the original pick. Golden
vectors (worked by hand below), on both cores."""

from __future__ import annotations

from types import ModuleType

import pytest

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
def test_the_cost_golden_vectors(
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


def test_a_cost_of_one_is_the_pick_without_one(core: ModuleType) -> None:
    ring = core.Ring(MEMBERS)
    for loads in ([0, 0, 0, 0], [3, 0, 0, 0], [9, 9, 1, 0], [5, 4, 3, 2]):
        assert ring.pick(KEY, loads, 2, 1.25, 2) == ring.pick(KEY, loads, 2, 1.25, 2, cost=1)


@pytest.mark.parametrize(
    ("cost", "error", "message"),
    [
        (0, ValueError, "a request's cost must be in 1.."),
        (-3, ValueError, "a request's cost must be in 1.."),
        ((1 << 40) + 1, ValueError, "a request's cost must be in 1.."),
        (True, TypeError, "cost must be an int >= 1"),
        (2.0, TypeError, "cost must be an int >= 1"),
    ],
)
def test_a_bad_cost_says_what_to_fix(
    core: ModuleType, cost: object, error: type[Exception], message: str
) -> None:
    ring = core.Ring(MEMBERS)
    with pytest.raises(error, match=message):
        ring.pick(KEY, [0, 0, 0, 0], cost=cost)


def test_the_total_and_the_cost_must_fit_in_int64(core: ModuleType) -> None:
    ring = core.Ring(MEMBERS)
    loads = [(1 << 62), (1 << 62) - 2, 0, 0]  # sum 2**63 - 2, the most a total may be
    assert ring.pick(KEY, loads, cost=1)[1] in ("home", "spill", "fallback")
    with pytest.raises(ValueError, match="plus the cost 2 is over 2\\*\\*63 - 1"):
        ring.pick(KEY, loads, cost=2)
