"""kv_events=true in a running sidecar: the KV events of the registered prefixes' home pods
feed the residency, the prefixes' token ids are kept current as prefixes and healthy pods
change, and a home pod that lost a prefix is prewarmed with it again (reprewarm.py).

Only home sets are followed, so a sidecar's subscriptions are bounded by prefixes x
replicas, not by the fleet; they are worked out again when the prefixes or the target ring
change. With unregistered_routing precise (and no kv_index_url) every member is followed,
into the fleet's block map too (fleet_blocks.py), which precise routing reads (precise.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from prefix_sidecar.config import Config
from prefix_sidecar.kv_events.fleet_blocks import BothSinks, FleetBlocks
from prefix_sidecar.kv_events.precise import PreciseRouting
from prefix_sidecar.kv_events.prefix_tokens import PrefixTokens
from prefix_sidecar.kv_events.reprewarm import ReprewarmSink
from prefix_sidecar.kv_events.residency import Residency
from prefix_sidecar.kv_events.subscriber import KvEventSubscriber
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.metrics import Metrics
from prefix_sidecar.prefixes import PrefixEntry, PrefixStore
from prefix_sidecar.prewarm import WARMED, Prewarmer
from prefix_sidecar.routing.router import Router
from prefix_sidecar.upstream.client import UpstreamClient


class KvEventsFollow:
    """The subscriber and the prefix token ids, started and stopped together."""

    def __init__(
        self,
        client: UpstreamClient,
        residency: Residency,
        store: PrefixStore,
        pool: BackendPool,
        metrics: Metrics,
        prewarmer: Prewarmer,
        router: Router,
        config: Config,
    ) -> None:
        home_set = router.home_set

        async def warm(entry: PrefixEntry, url: str) -> None:
            for event in await prewarmer.warm_all([(entry, url)]):
                # As server/warm_before_serve.note_prewarm, which kv_events may not import.
                metrics.child(metrics.prewarm, url, event.state.lower()).inc()
                if event.state == WARMED and store.has_id(entry.id):
                    pool.note_warm_prefix(url, entry.id)

        self.reprewarm = ReprewarmSink(
            residency,
            store,
            home_set,
            warm,
            lambda reason: metrics.child(metrics.reprewarms, reason).inc(),
            lambda url: pool.backends[url].warm_prefixes if url in pool.backends else set(),
            lambda url, count: resident(metrics, url, count),
            lambda url: over_share(pool, url),
            interval_s=config.reprewarm_interval_s,
        )
        # Precise routing reads every pod's blocks: it follows the whole fleet.
        # (the shared index instead, with kv_index_url: kv_index/lookup.py)
        precise = config.unregistered_routing == "precise" and not config.kv_index_url
        self.blocks = FleetBlocks() if precise else None
        if self.blocks is not None:
            PreciseRouting.install(client, self.blocks, router, config, metrics)
        self.subscriber = KvEventSubscriber(
            client,
            self.reprewarm if self.blocks is None else BothSinks(self.reprewarm, self.blocks),
            on_outcome=lambda url, outcome: metrics.child(metrics.kv_events, url, outcome).inc(),
            on_lag=lambda url, s: metrics.child(metrics.kv_event_lag, url).set(s),
        )
        self.tokens = PrefixTokens(
            store,
            client,
            self.reprewarm,
            lambda: sorted(u for u, b in pool.backends.items() if b.healthy),
            model=config.model,
        )
        self.store, self.pool, self.home_set = store, pool, home_set
        self.members: frozenset[str] = frozenset()
        self._followed: tuple[object, int, frozenset[str]] | None = None
        store.watch(self.tokens.wake)
        store.watch(self.follow_homes)
        pool.watch(lambda _table: self.tokens.wake())
        pool.watch(lambda _table: self.follow_homes())

    def start(self) -> asyncio.Task[None]:
        """The token-id task (the caller owns it); the subscriber follows set_pods()."""
        self.tokens.wake()
        return asyncio.create_task(self.tokens.run(), name="prefix-token-ids")

    def set_pods(self, urls: Iterable[str]) -> None:
        """The fleet's members: of them, the home sets' pods are followed."""
        self.members = frozenset(urls)
        self.follow_homes()

    def follow_homes(self) -> None:
        ring = self.pool.target_ring()
        state = (ring, self.store.generation, self.members)
        last = self._followed
        if last is not None and last[0] is ring and last[1:] == state[1:]:
            return  # same ring, prefixes and members: same home sets
        self._followed = state
        if self.blocks is not None:
            followed = sorted(self.members)
        else:
            homes = {url for entry in self.store for url in self.home_set(entry)}
            followed = sorted(homes & self.members)
        self.subscriber.set_pods(followed)
        self.reprewarm.keep_pods(followed)

    async def stop(self) -> None:
        await self.subscriber.stop()
        self.reprewarm.stop()


def resident(metrics: Metrics, url: str, count: int | None) -> None:
    """prefix_sidecar_resident_prefixes for `url`; no series while its state is unknown."""
    if count is None:
        metrics.remove(metrics.resident_prefixes, url)
    else:
        metrics.child(metrics.resident_prefixes, url).set(count)


def over_share(pool: BackendPool, url: str) -> bool:
    """Whether `url` has more requests in flight than the healthy pods' mean (this sidecar's
    own, or the pod's report where load signals are on): a prefill there delays them."""
    loads = [backend.requests for backend in pool.backends.values() if backend.healthy]
    backend = pool.backends.get(url)
    return backend is not None and bool(loads) and backend.requests > sum(loads) / len(loads)
