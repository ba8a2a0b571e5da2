"""The checks a ring and a Maglev table share against their golden vectors: both split the
64-bit key space among the same members and answer owner and preference lookups the same
way (routing contract sections 5 and 8), so one check reads both."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

KEY_SPACE = 1 << 64


def ring_from(core: Any, spec: dict[str, Any]) -> Any:
    """The ring of a golden ring spec, from the twin `core`."""
    return core.Ring(spec["members"], spec["weights"], spec["vnodes"])


def maglev_from(core: Any, spec: dict[str, Any]) -> Any:
    """The Maglev table of a golden Maglev spec, from the twin `core`."""
    return core.Maglev(spec["members"], spec["weights"], spec["table_size"])


def assert_golden_shares(table: Any, spec: dict[str, Any]) -> None:
    """The golden members and weights, and each member's share exactly its golden arc of the
    key space, arcs summing to it."""
    assert table.members == tuple(spec["members"]) and table.weights == tuple(spec["weights"])
    owned = {member: int(arc) for member, arc in spec["owned"].items()}
    assert sum(owned.values()) == KEY_SPACE
    shares = table.shares()
    for member in spec["members"]:
        assert shares[member] == owned[member] / KEY_SPACE == spec["shares"][member]


def assert_golden_lookups(table: Any, spec: dict[str, Any]) -> None:
    """Owner and preference lists at the golden keys; asking for more members than there
    are gives them all."""
    count = len(spec["members"])
    for lookup in spec["lookups"]:
        key = int(lookup["key"])
        assert table.owner(key) == lookup["owner"], key
        assert table.preference(key, 1) == [lookup["owner"]]
        assert table.preference(key, 2) == lookup["preference_2"]
        assert table.preference(key, count) == lookup["preference_all"]
        assert table.preference(key, count + 3) == lookup["preference_all"]


def golden_picks(
    core: Any, cases: list[dict[str, Any]]
) -> Iterator[tuple[dict[str, Any], int, tuple[str, str], int]]:
    """(case, key, the (member, branch) expected, min_cap) of each pick vector, once the
    vectors are seen to cover every branch and each key to be the route key of its text."""
    assert {case["branch"] for case in cases} == {"home", "spill", "fallback"}, (
        "the vectors must cover every branch"
    )
    for case in cases:
        key = int(case["key"])
        assert key == core.route_key(case["key_of"].encode())
        yield case, key, (case["member"], case["branch"]), int(case["min_cap"])
