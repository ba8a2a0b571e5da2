"""random: a uniformly random pod, ignoring the key. Baseline.

Complexity: O(1).
"""

from __future__ import annotations

import random

from prefix_sidecar.routing.pick import Branch, Pick
from prefix_sidecar.routing.table import RoutingTable


class RandomPick:
    ignores_key = True  # the router computes no organic keys for it

    def __init__(self, seed: int = 0) -> None:
        self._random = random.Random(seed)

    def select(self, table: RoutingTable, pick: Pick) -> tuple[str, Branch]:
        members = table.members
        return members[self._random.randrange(len(members))], Branch.RANDOM
