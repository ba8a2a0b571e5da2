"""Balancing the requests that start a flow (routing contract 9f, "starts").

A home set is a hash placement: with few families the pods get uneven sums of traffic, and
a session's later turns must land where its first one did, so they cannot be moved. A
request that STARTS a flow - a one-shot question, a session's first turn, a few-shot query -
has no history on any pod, only its family's head, which is warm on every pod of the home
set. Such a request can go to any pod of the home set at no cost in hit rate, so it goes
to the one this sidecar has sent the fewest organic requests lately. Its session's second
turn goes to the session's home as every later turn does (it recomputes the first user
message, tens of tokens, when the start went elsewhere), and every sidecar finds that
home alike: no sidecar needs to know where another sent a start.

A family's sessions live on the first pods of its home set (its session set, contract 9f),
where the family's requests keep its head warm; a pod past them sees the family only when a
start is sent there, so it may never have computed the head, or have evicted it since. A start goes
there only when that pod is counted lower by a margin that grows with the head it may have
to recompute (`far_margin`): balance is bought where it is cheap in hit rate.

The counts are this sidecar's own: each sidecar evens out the requests it sends, so K
sidecars even out the sum. They decay (half-life ~139 decisions), so they follow the
traffic of the last few hundred requests, not of the whole uptime. Bounded: one float per
member of the ring, rebuilt when the membership changes.
"""

from __future__ import annotations

from prefix_sidecar import _core

DECAY = 0.995  # per organic decision: a request counts half after 139 more
# A start leaves its session's home only for a pod counted at least one request lower:
# on a near tie the start stays where the session's next turns will go.
MARGIN = 1.0
# A start leaves the session set for a pod counted at least FAR_MARGIN + FAR_MARGIN_PER_KB x
# (the family's head in KB) requests lower: one that may have to recompute the head.
FAR_MARGIN = 2.0
FAR_MARGIN_PER_KB = 2.0
_RESCALE_ABOVE = 1e100  # counts grow by 1/DECAY per decision; rescaled long before overflow


class StartBalancer:
    """Decayed counts of the organic requests this sidecar sent to each pod."""

    def __init__(self, decay: float = DECAY, margin: float = MARGIN) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay is {decay}; it must be in (0, 1]")
        if margin < 0.0:
            raise ValueError(f"margin is {margin}; it must be >= 0")
        self.decay = decay
        self.margin = margin
        self._ring: _core.HashTable | None = None
        self._index: dict[str, int] = {}
        self._counts: list[float] = []
        # Decay without touching every count: a request adds `_unit`, which grows by
        # 1/decay per decision, so older additions weigh less relative to new ones.
        self._unit = 1.0

    def _follow(self, ring: _core.HashTable) -> None:
        """A new ring (membership changed): keep the counts of the pods still in it."""
        if ring is self._ring:
            return
        old = {url: self._counts[i] for url, i in self._index.items()}
        self._ring = ring
        self._index = {url: i for i, url in enumerate(ring.members)}
        self._counts = [old.get(url, 0.0) for url in ring.members]

    def choose(
        self,
        ring: _core.HashTable,
        family: int,
        homes: int,
        session_home: int,
        sessions: int | None = None,
        far_margin: float | None = None,
    ) -> int:
        """The member index a start goes to: of the family's first `homes` pods, the least
        counted (ties: the family's order) of those counted lower than the session's home
        by the margin - MARGIN for the first `sessions` (default all), `far_margin` for the
        rest (default MARGIN); the session's home when none is."""
        self._follow(ring)
        counts, index, unit = self._counts, self._index, self._unit
        near = self.margin * unit
        far = near if far_margin is None else far_margin * unit
        if sessions is None:
            sessions = homes
        ceiling = counts[session_home]
        least = session_home
        lowest = ceiling
        for position, url in enumerate(ring.preference(family, homes)):
            member = index[url]
            count = counts[member]
            if count < lowest and ceiling - count >= (near if position < sessions else far):
                least, lowest = member, count
        return least

    def sent(self, ring: _core.HashTable, backend: str) -> None:
        """Count one organic request sent to `backend` (every organic decision counts)."""
        self._follow(ring)
        member = self._index.get(backend)
        if member is None:
            return  # not a member of this ring (a failover target chosen elsewhere)
        self._counts[member] += self._unit
        self._unit /= self.decay
        if self._unit > _RESCALE_ABOVE:
            scale = 1.0 / self._unit
            self._counts = [count * scale for count in self._counts]
            self._unit = 1.0

    def counts(self) -> dict[str, float]:
        """The current counts in requests (decayed), per pod: for tests and debugging."""
        unit = self._unit
        return {url: self._counts[i] / unit for url, i in self._index.items()}
