"""Warm before serve: a (re)joining pod is prewarmed with the prefixes it is home for, then
admitted to the ring (config `warm_before_serve`); a warm prefix whose homes move is
prewarmed on its new homes.

One warm-up per pod: a pod that rejoins while it warms starts over (the first is cancelled).
A pod that cannot be warmed still serves, cold: losing capacity at peak is worse than one
slow first request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from prefix_sidecar.membership.pool import SERVING, BackendPool
from prefix_sidecar.metrics import Metrics
from prefix_sidecar.prefixes import PrefixEntry, PrefixStore
from prefix_sidecar.prewarm import FAILED, WARMED, Prewarmer, WarmEvent
from prefix_sidecar.routing.router import Router

logger = logging.getLogger(__name__)

# Seconds between NewHomeWarmup's own passes: they find a home that moved during a prewarm.
NEW_HOME_CHECK_S = 5.0
# A pass reads every prefix's home set (~5 ms for 1,024): it yields to the loop this often.
PREFIXES_PER_STEP = 256


def note_prewarm(event: WarmEvent, store: PrefixStore, pool: BackendPool, metrics: Metrics) -> None:
    """Count a final prewarm event; WARMED marks its pod warm if the prefix is registered."""
    if event.state in (WARMED, FAILED):
        metrics.child(metrics.prewarm, event.backend, event.state.lower()).inc()
    if event.state == WARMED and store.has_id(event.prefix_id):
        pool.note_warm_prefix(event.backend, event.prefix_id)


@dataclass
class JoinerWarmup:
    """The pool's `on_warm_needed`: one task per joining pod, ended by `take_tasks`."""

    prewarmer: Prewarmer
    store: PrefixStore
    router: Router
    pool: BackendPool
    metrics: Metrics
    _warming: dict[str, asyncio.Task[None]] = field(default_factory=dict, init=False)

    def __call__(self, url: str) -> None:
        previous = self._warming.pop(url, None)
        if previous is not None:
            previous.cancel()
        self._warming[url] = asyncio.get_running_loop().create_task(self._warm_then_admit(url))

    def take_tasks(self) -> list[asyncio.Task[None]]:
        """The warm-ups still running, handed to the caller to cancel and await."""
        tasks = list(self._warming.values())
        self._warming.clear()
        return tasks

    async def _warm_then_admit(self, url: str) -> None:
        pairs = [(entry, url) for entry in self.store if url in self.router.home_set(entry)]
        if pairs:
            logger.info("warming %s with %d prefix(es) before it serves", url, len(pairs))
            for event in await self.prewarmer.warm_all(pairs):
                note_prewarm(event, self.store, self.pool, self.metrics)
                if event.state != WARMED:
                    logger.warning("backend %s serves cold: its prewarm failed", url)
                    logger.debug("backend %s prewarm error: %s", url, event.error)
        self._warming.pop(url, None)
        self.pool.mark_warm(url)


@dataclass
class NewHomeWarmup:
    """Keeps a warm prefix warm on its homes when the placement moves them.

    Homes move after registration: the pods report their KV size (vLLM's cache_config_info),
    a pod counts the prefix's tokens, a pod leaves. Each call prewarms every prefix already
    warm somewhere on each serving home that lacks it (joining pods are JoinerWarmup's).
    One pass at a time: a call during a pass asks for another; `run` adds one every
    NEW_HOME_CHECK_S. Call only from the event loop, once the sidecar has started.
    """

    prewarmer: Prewarmer
    store: PrefixStore
    router: Router
    pool: BackendPool
    metrics: Metrics
    # True while prefixes are being counted (the sizer's pass): their counts move homes
    # again, so the pass waits for them and runs when the counting ends.
    counting: Callable[[], bool] = lambda: False
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _again: bool = field(default=False, init=False)

    def __call__(self) -> None:
        if self.counting():
            return
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.get_running_loop().create_task(self._warm_new_homes())

    async def run(self) -> None:
        while True:
            await asyncio.sleep(NEW_HOME_CHECK_S)
            self()

    async def settle(self) -> None:
        """Ask for a pass and return once none runs: every warm prefix is warm on its serving
        homes, or its prewarm there failed."""
        self()
        while self._task is not None and not self._task.done():
            await asyncio.wait([self._task])

    def take_tasks(self) -> list[asyncio.Task[None]]:
        """The pass still running, handed to the caller to cancel and await."""
        task, self._task = self._task, None
        return [task] if task is not None and not task.done() else []

    async def missing(self) -> list[tuple[PrefixEntry, str]]:
        """(prefix, pod) pairs to warm: the prefix is warm on some pod, the pod is one of its
        homes, serving, and not warm with it."""
        backends = self.pool.backends
        warm_anywhere: set[str] = set().union(*(b.warm_prefixes for b in backends.values()))
        pairs = []
        for count, entry in enumerate(self.store, 1):
            if count % PREFIXES_PER_STEP == 0:
                await asyncio.sleep(0)
            if entry.id not in warm_anywhere:
                continue  # never prewarmed (or not yet): its registration's prewarm decides
            for url in self.router.home_set(entry):
                backend = backends.get(url)
                if (
                    backend is not None
                    and backend.state == SERVING
                    and entry.id not in backend.warm_prefixes
                ):
                    pairs.append((entry, url))
        return pairs

    async def _warm_new_homes(self) -> None:
        while True:
            self._again = False
            pairs = await self.missing()
            if pairs:
                logger.info("placement moved: warming %d prefix home(s)", len(pairs))
                for event in await self.prewarmer.warm_all(pairs):
                    note_prewarm(event, self.store, self.pool, self.metrics)
            if not self._again:
                return
