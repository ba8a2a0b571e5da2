"""random: a uniformly random pod, ignoring the key. Baseline.

Complexity: O(1).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from sidecar.membership.pool import RoutingTable


class RandomPick:
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._random = random.Random(seed)

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
        return members[self._random.randrange(len(members))], "random"
