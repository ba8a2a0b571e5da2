"""The routers the core is measured against: docs/mission.md's, and uhashring.

`NoteRouter` is equivalent to docs/mission.md's reference router (MD5 of node names, 3 virtual nodes
per pod, a sorted list and bisect), written the way such routers usually are. `UhashringRouter`
wraps uhashring's default HashRing (MD5, 160 points per node). Neither has a bounded-load pick,
so `LoadCheckedPick` adds the cheapest honest equivalent on top of their `get_node`: a cap
check at the owner and, when it is over the cap, the least-loaded pod of all.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Sequence

from uhashring import HashRing

MD5_SPACE = 1 << 128  # both baselines place points and keys in the 128-bit MD5 space


class NoteRouter:
    """docs/mission.md's router: md5(f"{node}:{i}") for 3 points per pod; get_node bisects."""

    def __init__(self, nodes: Sequence[str], virtual_nodes: int = 3) -> None:
        self.virtual_nodes = virtual_nodes
        self.ring: dict[int, str] = {}
        self.sorted_keys: list[int] = []
        for node in nodes:
            self.add_node(node)

    @staticmethod
    def _hash(key: str) -> int:
        return int(hashlib.md5(key.encode()).hexdigest(), 16)

    def add_node(self, node: str) -> None:
        for i in range(self.virtual_nodes):
            point = self._hash(f"{node}:{i}")
            self.ring[point] = node
            bisect.insort(self.sorted_keys, point)

    def get_node(self, key: str) -> str:
        index = bisect.bisect(self.sorted_keys, self._hash(key)) % len(self.sorted_keys)
        return self.ring[self.sorted_keys[index]]

    def points(self) -> list[tuple[int, str]]:
        return [(point, self.ring[point]) for point in self.sorted_keys]


class UhashringRouter:
    """uhashring.HashRing with its defaults; get_node is uhashring's own method."""

    def __init__(self, nodes: Sequence[str]) -> None:
        self.ring = HashRing(nodes=list(nodes))
        self.get_node: Callable[[str], str] = self.ring.get_node

    def points(self) -> list[tuple[int, str]]:
        return [(int(point), str(node)) for point, node in self.ring.get_points()]


def exact_shares(points: Sequence[tuple[int, str]], space: int) -> dict[str, float]:
    """The exact fraction of the key space each node owns: one arc per point, wrapping."""
    owned: dict[str, int] = {}
    previous = points[-1][0] - space
    for point, node in points:
        owned[node] = owned.get(node, 0) + point - previous
        previous = point
    return {node: arc / space for node, arc in owned.items()}


class LoadCheckedPick:
    """get_node plus a bounded-load check, for baselines that have none.

    Equal weights: cap = ceil(factor * (total_load + 1) / N). The owner is kept if
    load + 1 <= cap; otherwise the least-loaded pod of all is taken (no spill order, no
    replica set - less work than the core's pick, so the comparison favours the baseline).
    """

    def __init__(
        self, get_node: Callable[[str], str], members: Sequence[str], factor: float = 1.25
    ) -> None:
        self._get_node = get_node
        self._members = list(members)
        self._index = {member: i for i, member in enumerate(self._members)}
        self._factor = factor

    def pick(self, key: str, loads: Sequence[int]) -> str:
        node = self._get_node(key)
        count = len(self._members)
        if loads[self._index[node]] + 1 <= math.ceil(self._factor * (sum(loads) + 1) / count):
            return node
        return self._members[min(range(count), key=loads.__getitem__)]
