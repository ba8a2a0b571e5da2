"""round_robin: the next pod in turn, ignoring the key. Baseline: spreads load evenly and
scatters every prefix over every pod, so each pod keeps recomputing it.

Complexity: O(1).
"""

from __future__ import annotations

import itertools

from prefix_sidecar.routing.pick import Branch, Pick
from prefix_sidecar.routing.table import RoutingTable


class RoundRobin:
    ignores_key = True  # the router computes no organic keys for it

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, table: RoutingTable, pick: Pick) -> tuple[str, Branch]:
        members = table.members
        return members[next(self._counter) % len(members)], Branch.ROUND_ROBIN
