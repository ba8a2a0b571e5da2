"""Warm before serve: a (re)joining pod is prewarmed with the prefixes it is home for, then
admitted to the ring (config `warm_before_serve`).

One warm-up per pod: a pod that leaves and rejoins while it warms starts over, and the
first warm-up is cancelled. A pod that cannot be warmed still serves, cold: losing capacity
at peak is worse than one slow first request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.metrics import Metrics
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.prewarm import WARMED, Prewarmer
from prefix_sidecar.routing.router import Router

logger = logging.getLogger(__name__)


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
        warmed = []
        if pairs:
            logger.info("warming %s with %d prefix(es) before it serves", url, len(pairs))
            for event in await self.prewarmer.warm_all(pairs):
                self.metrics.child(self.metrics.prewarm, url, event.state.lower()).inc()
                if event.state != WARMED:
                    logger.warning("backend %s serves cold: its prewarm failed", url)
                    logger.debug("backend %s prewarm error: %s", url, event.error)
                elif self.store.has_id(event.prefix_id):
                    # A prefix unregistered while it warmed is not reported warm.
                    warmed.append(event.prefix_id)
        self._warming.pop(url, None)
        self.pool.mark_warm(url, warmed)
