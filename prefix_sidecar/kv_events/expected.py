"""Blocks a pod is about to hold: prompts this sidecar has just sent it, credited before the
pod's events can say so, so a second request with the same new prefix is not routed as if no
pod held it and computed twice (SGLang's and Dynamo's routers count in-flight prompts too).
Other sidecars learn of it from the pod's events only.

A credit lasts EXPECT_S, or until a first token of ours from that pod for a request sent at
or after it (`prefilled`): vLLM caches a prompt's full blocks, and says so, as it schedules
the prefill, first come first served, so from then on the pod's events are the truth,
evictions included. Bounded: at most MAX_EXPECTED keys over all pods, oldest dropped first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

# Above the longest prefill here plus the event's trip (bench organic, time x6: ~0.35 s).
EXPECT_S = 2.0
MAX_EXPECTED = 1 << 16  # 8-byte keys and their (pod, key) entries: ~10 MB at most


class ExpectedBlocks:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._until: dict[str, set[int]] = {}  # pod -> our keys credited to it
        # (pod, key) -> until when, oldest first over all pods (one EXPECT_S for all: credit
        # order is expiry order), so the oldest goes in O(1).
        self._order: dict[tuple[str, int], float] = {}
        # pod -> credits made by then are settled: the pod's events say the rest (prefilled)
        self._settled: dict[str, float] = {}

    def expect(self, pod: str, keys: Sequence[int]) -> None:
        """`pod` is about to compute a prompt: credit it with its whole blocks' `keys`
        (block_keys.chain at the pods' block size)."""
        now = self.clock()
        self._expire(now)
        until = now + EXPECT_S
        credited = self._until.setdefault(pod, set())
        for key in keys:
            credited.add(key)
            self._order.pop((pod, key), None)
            self._order[(pod, key)] = until  # moved to the end: expiry order kept
        while len(self._order) > MAX_EXPECTED:
            self._drop_first()

    def prefilled(self, pod: str, sent_at: float) -> None:
        """A request of ours sent to `pod` at `sent_at` had its first token: the pod has
        scheduled every request we sent it by then, and its events hold their blocks, so
        their credits end. `sent_at` is read on the pool's prefill queues' clock, which must
        be this object's (both time.monotonic in a sidecar)."""
        if pod in self._until:
            self._settled[pod] = max(self._settled.get(pod, sent_at), sent_at)

    def matches(self, keys: Sequence[int], block_size: int) -> dict[str, int]:
        """Per pod, the tokens of a prompt (its chain's `keys` at `block_size`) it is
        credited with in whole blocks from the first on (pods credited with none are
        absent)."""
        self._expire(self.clock())
        if not self._until:
            return {}
        found, order = {}, self._order
        for pod, credited in self._until.items():
            # a credit made at or before the settled time (until - EXPECT_S) no longer counts
            settled_until = self._settled.get(pod, -math.inf) + EXPECT_S
            count = 0
            for key in keys:
                if key not in credited or order[(pod, key)] <= settled_until:
                    break
                count += 1
            if count:
                found[pod] = count * block_size
        return found

    def _expire(self, now: float) -> None:
        while self._order and next(iter(self._order.values())) <= now:
            self._drop_first()

    def _drop_first(self) -> None:
        pod, key = next(iter(self._order))
        del self._order[(pod, key)]
        keys = self._until[pod]
        keys.discard(key)
        if not keys:
            del self._until[pod]
            self._settled.pop(pod, None)


# About the time a busy pod's cache turns over: a pod's figure says how much of what it was
# sent it may still hold, not all it was ever sent.
INFLOW_TAU_S = 60.0


class ContentInflow:
    """Per pod, the prompt tokens this sidecar sent it to compute (not cached there),
    decayed with INFLOW_TAU_S: where new content has been piling up. A cold prompt goes to
    the pod with the least, as SGLang's router sends one to the worker with the least text
    in its tree; each sidecar counts its own requests, a sample of the fleet's traffic."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._tokens: dict[str, tuple[float, float]] = {}  # pod -> (tokens, as of when)

    def add(self, pod: str, tokens: int) -> None:
        now = self.clock()
        self._tokens[pod] = (self._at(pod, now) + tokens, now)

    def of(self, pods: Sequence[str]) -> dict[str, float]:
        """Per pod of `pods` (the fleet now: any other pod is forgotten, so pod churn
        leaves nothing behind), its figure."""
        now, members = self.clock(), set(pods)
        if not self._tokens.keys() <= members:
            self._tokens = {pod: v for pod, v in self._tokens.items() if pod in members}
        return {pod: self._at(pod, now) for pod in pods}

    def _at(self, pod: str, now: float) -> float:
        tokens, when = self._tokens.get(pod, (0.0, now))
        return tokens * math.exp(-(now - when) / INFLOW_TAU_S)
