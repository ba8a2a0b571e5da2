"""Budgeted home placement: the pods each registered prefix calls home (routing contract
section 6). Bounded load caps in-flight requests, not KV bytes; this caps homed KV too.

With a budget B (prefix KV tokens per unit of pod weight), prefixes are placed largest first
(ties: route key, then id), each on the first R pods of its preference order with room, else
over budget on the least-filled others (a prefix must live somewhere); an optional balance
factor f also caps each pod at f times its fair share. The result depends only on the ring
and the registered set, so sidecars agree without talking. Complexity: O(P log P + P x N)
per membership or registration change, off the request path; one dict lookup per request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field
from fractions import Fraction

from prefix_sidecar import _core
from prefix_sidecar.prefixes import PrefixEntry, PrefixStore

# A prefix's KV size before a pod's tokenizer counted it: UTF-8 bytes per token, ~4 for
# English with a BPE tokenizer (the emulator's exactly). A parameter of the placement like B
# (routing contract section 6): sidecars that size alike place alike.
BYTES_PER_TOKEN = 4.0
# The balance factor f, 0 = off: 1.1 helped in bench fleet but packed the demo's small
# prefixes onto one pod (docs/benchmarks.md "Fleet results", "Demo results").
HOME_BALANCE_FACTOR = 0.0
# With no home_kv_budget_tokens, the budget is this share of the pods' smallest reported KV
# (docs/load-signals.md section 4): the other half is for the in-flight requests' tokens.
HOME_KV_FRACTION = 0.5


@dataclass(frozen=True)
class Homes:
    """One prefix's placement on one ring, ready for the request path."""

    indexes: tuple[int, ...]  # the home set, member indexes in preference order
    order: tuple[str, ...]  # the home set's members, then every other in the key's order


@dataclass(frozen=True)
class Placed:
    """One prefix to place: its route key, KV size in tokens, replica count and id."""

    key: int
    tokens: int
    replicas: int
    id: str  # the prefix id: a total order even if two route keys collide


def place(
    ring: _core.HashTable, prefixes: Iterable[Placed], budget: int, balance: float = 0.0
) -> dict[str, list[int]]:
    """Home sets by prefix id, as member indexes in the prefix's preference order.

    Member m may be home to `budget x w_m` prefix tokens and, with `balance` > 0, to no more
    than ceil(balance x T x w_m / W), T being the tokens of every replica of every prefix:
    the ring alone can leave a pod home to nothing while the others carry all the traffic.
    """
    placed = _place(ring, prefixes, budget, balance)
    return {prefix_id: homes for prefix_id, (homes, _) in placed.items()}


def _place(
    ring: _core.HashTable, prefixes: Iterable[Placed], budget: int, balance: float = 0.0
) -> dict[str, tuple[list[int], list[int]]]:
    """(home set, whole preference order) by prefix id, both as member indexes."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget is {budget!r}; give the prefix KV tokens per pod, >= 1")
    if not (balance == 0.0 or 1.0 <= balance < math.inf):
        raise ValueError(f"balance is {balance!r}; give 0 (off) or a finite factor >= 1.0")
    members = ring.members
    count = len(members)
    index = {member: i for i, member in enumerate(members)}
    items = list(prefixes)
    limit = [budget * weight for weight in ring.weights]
    if balance:
        # The contract's order of double operations, as in pick's cap: ceil(f * T * w / W).
        total = float(sum(p.tokens * min(p.replicas, count) for p in items))
        for m, weight in enumerate(ring.weights):
            fair = math.ceil(balance * total * float(weight) / float(ring.total_weight))
            limit[m] = min(limit[m], fair)
    used = [0] * count
    homes: dict[str, tuple[list[int], list[int]]] = {}
    for prefix in sorted(items, key=lambda p: (-p.tokens, p.key, p.id)):
        want = min(prefix.replicas, count)
        order = [index[m] for m in ring.preference(prefix.key, count)]
        chosen = [m for m in order if used[m] + prefix.tokens <= limit[m]][:want]
        if len(chosen) < want:
            # No room left for all R: the least-filled others (exact ratios, no float ties).
            rest = [m for m in order if m not in chosen]
            rest.sort(key=lambda m: Fraction(used[m], ring.weights[m]))
            taken = set(chosen) | set(rest[: want - len(chosen)])
            chosen = [m for m in order if m in taken]
        for m in chosen:
            used[m] += prefix.tokens
        homes[prefix.id] = (chosen, order)
    return homes


@dataclass(eq=False)
class HomePlacer:
    """The sidecar's placement, rebuilt (`rebuild`) from the pool's and store's watchers so
    a request only looks its prefix up; an unseen ring or registered set is placed on first
    use. `budget_tokens` 0 turns it off (homes: the ring's first R owners, contract v1).
    `replicas_of`: the replica count a registered prefix asks for (the router's).
    """

    store: PrefixStore
    replicas_of: Callable[[PrefixEntry], int]
    _: KW_ONLY
    budget_tokens: int
    bytes_per_token: float
    balance: float
    # id(ring) -> (ring, store generation, homes): the routing and the target ring (one
    # when every pod serves). Replaced whole, so a reader sees one consistent map.
    _placements: dict[int, tuple[_core.HashTable, int, dict[str, Homes]]] = field(
        default_factory=dict, init=False
    )
    # Placements computed: tests check that the request path computes none.
    builds: int = field(default=0, init=False)

    @property
    def enabled(self) -> bool:
        return self.budget_tokens > 0

    def tokens_of(self, entry: PrefixEntry) -> int:
        """The prefix's KV size: as a pod's tokenizer counted it, else from its UTF-8 bytes."""
        return entry.tokens or max(1, math.ceil(entry.size / self.bytes_per_token))

    def rebuild(self, *rings: _core.HashTable | None) -> None:
        """Place the registered set on each ring now, replacing every earlier placement."""
        if not self.enabled:
            return
        generation = self.store.generation
        placements: dict[int, tuple[_core.HashTable, int, dict[str, Homes]]] = {}
        for ring in rings:
            if ring is not None and id(ring) not in placements:
                placements[id(ring)] = (ring, generation, self._build(ring))
        self._placements = placements

    def homes(self, ring: _core.HashTable, entry: PrefixEntry) -> Homes | None:
        """The entry's home set on `ring` (member indexes), or None when placement is off or
        the entry is not registered (an inline prefix routes on the plain ring)."""
        if not self.enabled:
            return None
        return self._placement(ring).get(entry.id)

    def _placement(self, ring: _core.HashTable) -> dict[str, Homes]:
        generation = self.store.generation
        placed = self._placements.get(id(ring))
        if placed is not None and placed[0] is ring and placed[1] == generation:
            return placed[2]
        homes = self._build(ring)
        placements = dict(self._placements)
        if len(placements) >= 4:  # a few rings live at once (routing, target)
            placements.pop(next(iter(placements)))
        placements[id(ring)] = (ring, generation, homes)
        self._placements = placements
        return homes

    def _build(self, ring: _core.HashTable) -> dict[str, Homes]:
        self.builds += 1
        placed = _place(
            ring,
            (Placed(e.route_key, self.tokens_of(e), self.replicas_of(e), e.id) for e in self.store),
            self.budget_tokens,
            self.balance,
        )
        members = ring.members
        homes = {}
        for prefix_id, (chosen, order) in placed.items():
            rest = [m for m in order if m not in chosen]
            names = tuple(members[m] for m in (*chosen, *rest))
            homes[prefix_id] = Homes(tuple(chosen), names)
        return homes
