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
to recompute (`far_margin`): balance is bought where it is cheap in hit rate. A pod of the
session set that this sidecar has not yet sent any of the family's requests to is far too,
the session's own pod included: the session set is where the head will be warm, not where
it is. On real vLLM (4 pods, `bench real --workloads organic`, seed 3) a few-shot family's
every request went to one pod until a start moved to the second pod of its session set,
cold, and tenants' starts went to session pods that had never had the tenant: five or six
such starts a run cost 0.04-0.06 of the hit rate that SGLang's router and precise routing
kept.

The counts are this sidecar's own: each sidecar evens out the requests it sends, so K
sidecars even out the sum. They decay (half-life ~139 decisions), so they follow the
traffic of the last few hundred requests, not of the whole uptime. Bounded: one float per
member of the ring, rebuilt when the membership changes, and the pods each of the latest
WARM_FAMILIES families was sent to (an LRU, ~3 MB full).
"""

from __future__ import annotations

from collections import OrderedDict

from prefix_sidecar import _core

DECAY = 0.995  # per organic decision: a request counts half after 139 more
# A start leaves its session's home only for a pod counted at least one request lower:
# on a near tie the start stays where the session's next turns will go.
MARGIN = 1.0
# A start leaves the session set for a pod counted at least FAR_MARGIN + FAR_MARGIN_PER_KB x
# (the family's head in KB) requests lower: one that may have to recompute the head.
FAR_MARGIN = 2.0
FAR_MARGIN_PER_KB = 2.0
# Families whose pods are remembered (an LRU): as many as session follow's sessions.
WARM_FAMILIES = 16_384
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
        self._warm: OrderedDict[int, set[str]] = OrderedDict()  # family -> pods sent it

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
        """The member index a start goes to (contract 9f): of the family's first `homes`
        pods, the least costly (ties: the family's order) of those costing MARGIN less than
        the session's home; the home when none is. A pod costs its count; one that is not
        of the first `sessions` (default all) this sidecar sent the family to, `far_margin`
        (default MARGIN) less MARGIN more; the home that more only when the family was
        sent elsewhere but never there."""
        self._follow(ring)
        counts, index, unit = self._counts, self._index, self._unit
        near = self.margin * unit
        far = near if far_margin is None else far_margin * unit
        if sessions is None:
            sessions = homes
        warm = self._warm.get(family, ())
        # A pod that may have to compute the head counts `far - near` requests more: it is
        # chosen over a warm one only that much less loaded.
        cold = max(far - near, 0.0)
        ceiling = counts[session_home]
        if warm and ring.members[session_home] not in warm:
            ceiling += cold  # the session's pod never had the family: a warm pod may win
        least, lowest = session_home, ceiling
        for position, url in enumerate(ring.preference(family, homes)):
            member = index[url]
            cost = counts[member] + (0.0 if position < sessions and url in warm else cold)
            if member != session_home and cost < lowest and ceiling - cost >= near:
                least, lowest = member, cost
        return least

    def sent(self, ring: _core.HashTable, backend: str, family: int | None = None) -> None:
        """Count one organic request sent to `backend` (every organic decision counts),
        and that `family` (its key) was sent there."""
        self._follow(ring)
        member = self._index.get(backend)
        if member is None:
            return  # not a member of this ring (a failover target chosen elsewhere)
        if family is not None:
            pods = self._warm.get(family)
            if pods is None:
                pods = self._warm[family] = set()
                if len(self._warm) > WARM_FAMILIES:
                    self._warm.popitem(last=False)
            else:
                self._warm.move_to_end(family)
            pods.add(ring.members[member])
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
