"""Balance the requests that start a flow over the family's home set (routing contract 9f).

A start (a one-shot question, a session's first turn, a few-shot query) has no history on
any pod, only its family's head, so it goes to the pod this sidecar has sent the fewest
organic requests lately; later turns still go to the session's home, computed alike by
every sidecar. Past the session set the head may be cold, so a start goes there only by a
margin that grows with the head (`far_margin`). Counts are this sidecar's own (K sidecars
each even out theirs) and decay (half-life ~139 decisions). Bounded: one float per ring
member, carried over for the pods that stay when membership changes.
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
