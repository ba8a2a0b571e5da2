"""Hypothesis: the extension and the pure-Python twin agree to the bit, on anything.

Valid inputs must give identical results; invalid ones must raise the same exception type.
Rings are kept small (few vnodes) so that hundreds of examples run in seconds.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

member_ids = st.one_of(
    st.text(min_size=1, max_size=12),
    st.integers(0, 255).map(lambda i: f"http://10.0.{i // 16}.{i % 16}:8000"),
)
keys = st.one_of(
    st.integers(0, (1 << 64) - 1),
    st.sampled_from([0, 1, (1 << 63), (1 << 64) - 1]),
)
loads_value = st.one_of(
    st.integers(0, 20),
    st.integers(0, 1 << 20),
    st.sampled_from([1 << 51, 1 << 52, (1 << 53) - 1, 1 << 53]),
)
# The load-cap floor: mostly the small values a config holds, plus the int64 clamp edges.
min_caps = st.one_of(
    st.just(0),
    st.integers(0, 30),
    st.integers(0, 1 << 70),
    st.sampled_from([(1 << 53) + 1, (1 << 63) - 2, (1 << 63) - 1, 1 << 63, 1 << 64]),
)
# A request's cost: 1 (load in requests), a few requests' worth, a token count, the bounds.
costs = st.one_of(
    st.just(1),
    st.integers(1, 40),
    st.integers(1, 20_000),
    st.sampled_from([(1 << 40) - 1, 1 << 40]),
)
factors = st.one_of(
    st.sampled_from([1.0, 1.25, 1.5, 2.0, 1e20, 1e300]),
    st.floats(min_value=1.0, max_value=1e6, allow_nan=False),
)


@st.composite
def rings_and_picks(draw: st.DrawFn) -> dict[str, Any]:
    members = draw(st.lists(member_ids, min_size=1, max_size=10, unique=True))
    count = len(members)
    weights = draw(
        st.one_of(st.none(), st.lists(st.integers(1, 4), min_size=count, max_size=count))
    )
    return {
        "members": members,
        "weights": weights,
        "vnodes": draw(st.integers(1, 16)),
        "key": draw(keys),
        "loads": draw(st.lists(loads_value, min_size=count, max_size=count)),
        "replicas": draw(st.integers(1, count + 2)),
        "factor": draw(factors),
        "min_cap": draw(min_caps),
        "cost": draw(costs),
        "n": draw(st.integers(1, count + 2)),
        # An explicit home set for pick_among: distinct member indexes, in any order.
        "homes": draw(st.permutations(range(count)))[: draw(st.integers(1, count))],
    }


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Exception as exc:  # the twins must fail the same way
        return "raised", type(exc)


@FAST
@given(case=rings_and_picks())
def test_twins_agree_on_rings_and_picks(
    twins: tuple[ModuleType, ModuleType], case: dict[str, Any]
) -> None:
    c_core, py_core = twins
    c_ring = c_core.Ring(case["members"], case["weights"], case["vnodes"])
    py_ring = py_core.Ring(case["members"], case["weights"], case["vnodes"])
    assert c_ring.members == py_ring.members and c_ring.weights == py_ring.weights
    assert c_ring.points() == py_ring.points()
    assert c_ring.shares() == py_ring.shares()
    key = case["key"]
    assert c_ring.owner(key) == py_ring.owner(key)
    assert c_ring.preference(key, case["n"]) == py_ring.preference(key, case["n"])
    args = (case["replicas"], case["factor"], case["min_cap"])
    expected = py_ring.pick(key, case["loads"], *args)
    assert c_ring.pick(key, case["loads"], *args) == expected
    assert c_ring.pick(key, array("q", case["loads"]), *args) == expected
    assert py_ring.pick(key, array("q", case["loads"]), *args) == expected
    among = (case["homes"], case["factor"], case["min_cap"])
    expected = py_ring.pick_among(key, case["loads"], *among)
    assert c_ring.pick_among(key, case["loads"], *among) == expected
    assert c_ring.pick_among(key, array("q", case["loads"]), *among) == expected
    # pick is pick_among over the first R owners.
    first = [c_ring.members.index(m) for m in c_ring.preference(key, case["replicas"])]
    assert c_ring.pick_among(key, case["loads"], first, *args[1:]) == c_ring.pick(
        key, case["loads"], *args
    )
    # A request's cost: the same on both twins, and 1 is the pick without one.
    _assert_picks_agree_with_a_cost(c_ring, py_ring, case)
    assert c_ring.pick(key, case["loads"], *args, cost=1) == c_ring.pick(key, case["loads"], *args)


@FAST
@given(case=rings_and_picks(), size=st.sampled_from([11, 13, 101]))
def test_twins_agree_on_maglev_picks_with_a_cost(
    twins: tuple[ModuleType, ModuleType], case: dict[str, Any], size: int
) -> None:
    built = [
        _outcome(partial(core.Maglev, case["members"], case["weights"], size)) for core in twins
    ]
    if built[1][0] == "raised":  # more members than entries, or a weight too small for them
        assert built[0] == built[1]
        return
    c_table, py_table = built[0][1], built[1][1]
    assert c_table.table() == py_table.table()
    _assert_picks_agree_with_a_cost(c_table, py_table, case)


def _assert_picks_agree_with_a_cost(c_table: Any, py_table: Any, case: dict[str, Any]) -> None:
    """pick, pick_bytes and pick_among with case["cost"], summed and with the total given:
    the same answer, or the same exception type, from both twins."""
    key, loads, cost = case["key"], case["loads"], case["cost"]
    args = (case["replicas"], case["factor"], case["min_cap"])
    among = (case["homes"], case["factor"], case["min_cap"])
    data = key.to_bytes(8, "little")
    for total in (None, sum(loads)):
        asked: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("pick", (key, loads, *args, total, cost), {}),
            ("pick", (key, array("q", loads), *args), {"total": total, "cost": cost}),
            ("pick_bytes", (data, loads, *args, total, cost), {}),
            ("pick_among", (key, loads, *among, total, cost), {}),
        ]
        for method, arguments, keywords in asked:
            c_answer = _outcome(partial(getattr(c_table, method), *arguments, **keywords))
            py_answer = _outcome(partial(getattr(py_table, method), *arguments, **keywords))
            assert c_answer == py_answer, (method, total)


@FAST
@given(data=st.binary(max_size=300), text=st.text(max_size=80))
def test_twins_agree_on_hashing(
    twins: tuple[ModuleType, ModuleType], data: bytes, text: str
) -> None:
    c_core, py_core = twins
    assert c_core.route_key(data) == py_core.route_key(data)
    assert c_core.prefix_id(text) == py_core.prefix_id(text)
    assert c_core.prefix_route_key(text) == py_core.prefix_route_key(text)


anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.lists(st.integers(-3, 3), max_size=4),
)


@FAST
@given(arguments=st.tuples(*[anything] * 7))
# preference(key, n) with n past sys.maxsize: the twin's islice refused it (found by CI).
@example(arguments=(0, None, None, None, None, 1 << 63, None))
def test_twins_fail_alike_on_bad_arguments(
    twins: tuple[ModuleType, ModuleType], arguments: tuple[Any, ...]
) -> None:
    key, loads, replicas, factor, min_cap, n, homes = arguments
    calls: list[Callable[[ModuleType, Any], Any]] = [
        lambda core, ring: ring.owner(key),
        lambda core, ring: ring.preference(key, n),
        lambda core, ring: ring.pick(key, loads, replicas, factor),
        lambda core, ring: ring.pick(key, loads, replicas, factor, min_cap),
        lambda core, ring: ring.pick(7, loads),
        lambda core, ring: ring.pick(7, [1, 2, 3], min_cap=min_cap),
        lambda core, ring: core.route_key(key),
        lambda core, ring: ring.pick_among(key, loads, homes, factor, min_cap),
        lambda core, ring: ring.pick_among(7, [1, 2, 3], homes),
        lambda core, ring: ring.pick(7, [1, 2, 3], cost=n),
        lambda core, ring: ring.pick_bytes(b"x", [1, 2, 3], cost=min_cap),
        lambda core, ring: ring.pick_among(7, [1, 2, 3], [0], cost=n),
        lambda core, ring: ring.pick(7, [(1 << 62), (1 << 62) - 2, 0], cost=n),
    ]
    members = ["a", "b", "c"]
    rings = [(core, core.Ring(members, vnodes=4)) for core in twins]
    for call in calls:
        c_outcome, py_outcome = (_outcome(partial(call, core, ring)) for core, ring in rings)
        assert c_outcome == py_outcome


@FAST
@given(members=anything, weights=anything, vnodes=anything)
def test_twins_fail_alike_on_bad_rings(
    twins: tuple[ModuleType, ModuleType], members: Any, weights: Any, vnodes: Any
) -> None:
    c_core, py_core = twins

    def build(core: ModuleType) -> Any:
        ring = core.Ring(members, weights, vnodes)
        return ring.points(), ring.shares()

    assert _outcome(lambda: build(c_core)) == _outcome(lambda: build(py_core))


@FAST
@given(
    data=st.binary(max_size=700),
    block=st.one_of(st.integers(1, 80), st.sampled_from([64, 1 << 16])),
    most=st.one_of(st.integers(0, 20), st.just(1 << 70)),
)
def test_twins_agree_on_chain_keys(
    twins: tuple[ModuleType, ModuleType], data: bytes, block: int, most: int
) -> None:
    c_core, py_core = twins
    keys = py_core.chain_keys(data, block, most)
    assert c_core.chain_keys(data, block, most) == keys
    assert c_core.chain_keys(bytearray(data), block, most) == keys
    assert len(keys) == min(len(data) // block, most)
    # A chain is a chain: the keys of a prefix are a prefix of the keys.
    half = len(data) // 2
    assert py_core.chain_keys(data[:half], block, most) == keys[: half // block]


@FAST
@given(case=rings_and_picks(), session=keys, size=st.integers(1, 12))
def test_twins_agree_on_session_homes(
    twins: tuple[ModuleType, ModuleType], case: dict[str, Any], session: int, size: int
) -> None:
    c_core, py_core = twins
    c_ring = c_core.Ring(case["members"], case["weights"], case["vnodes"])
    py_ring = py_core.Ring(case["members"], case["weights"], case["vnodes"])
    family = case["key"]
    index = py_ring.session_home(family, size, session)
    assert c_ring.session_home(family, size, session) == index
    # It is a member of the family's home set, and the session's first choice in it.
    home = py_ring.preference(family, size)
    assert py_ring.members[index] in home
    order = py_ring.preference(session, len(py_ring.members))
    assert py_ring.members[index] == next(m for m in order if m in home)


@FAST
@given(data=anything, block=anything, most=anything, family=anything, size=anything)
# session_home with a home set past sys.maxsize: the twin's islice refused it.
@example(data=b"", block=64, most=1, family=1, size=1 << 63)
def test_twins_fail_alike_on_bad_organic_arguments(
    twins: tuple[ModuleType, ModuleType], data: Any, block: Any, most: Any, family: Any, size: Any
) -> None:
    c_core, py_core = twins
    assert _outcome(lambda: c_core.chain_keys(data, block, most)) == _outcome(
        lambda: py_core.chain_keys(data, block, most)
    )
    c_ring, py_ring = c_core.Ring(["a", "b", "c"], None, 8), py_core.Ring(["a", "b", "c"], None, 8)
    assert _outcome(lambda: c_ring.session_home(family, size, 5)) == _outcome(
        lambda: py_ring.session_home(family, size, 5)
    )
