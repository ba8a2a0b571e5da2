"""The bounded-load property both property tests check, written once (routing contract 4)."""

from __future__ import annotations

from typing import Any


def check_the_bound(
    table: Any,
    key: int,
    replicas: int,
    loads: list[int],
    members: list[str],
    answer: tuple[str, str],
    fits: dict[str, bool],
) -> None:
    """`answer` = pick(...): a home is the least-loaded home and fits, a spill fits, a
    fallback means no member fits and is the least loaded of all."""
    member, branch = answer
    home = table.preference(key, replicas)
    if branch == "home":
        assert member in home and fits[member]
        assert loads[members.index(member)] == min(loads[members.index(m)] for m in home)
    elif branch == "spill":
        assert fits[member]
    else:
        assert branch == "fallback" and not any(fits.values()), (answer, fits)
        assert loads[members.index(member)] == min(loads)
