"""round_robin: the next pod in turn, ignoring the key. Baseline: spreads load evenly and
scatters every prefix over every pod, so each pod keeps recomputing it.

Complexity: O(1).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from sidecar.membership.pool import RoutingTable


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(
        self,
        table: RoutingTable,
        key: int,
        replicas: int,
        factor: float,
        min_cap: int = 0,
        homes: Sequence[int] | None = None,
    ) -> tuple[str, str]:
        members = table.members
        return members[next(self._counter) % len(members)], "round_robin"
