"""kv_events=true in a running sidecar: each member's KV events feed the residency, and the
registered prefixes' token ids are kept current as prefixes and healthy pods change, and a
home pod that lost a registered prefix is prewarmed with it again (reprewarm.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from prefix_sidecar.kv_events.prefix_tokens import PrefixTokens
from prefix_sidecar.kv_events.reprewarm import ReprewarmSink
from prefix_sidecar.kv_events.residency import Residency
from prefix_sidecar.kv_events.subscriber import KvEventSubscriber
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.metrics import Metrics
from prefix_sidecar.prefixes import PrefixEntry, PrefixStore
from prefix_sidecar.prewarm import WARMED, Prewarmer
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
        model: str,
        prewarmer: Prewarmer,
        home_set: Callable[[PrefixEntry], list[str]],
    ) -> None:
        async def warm(entry: PrefixEntry, url: str) -> None:
            for event in await prewarmer.warm_all([(entry, url)]):
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
        )
        self.subscriber = KvEventSubscriber(
            client,
            self.reprewarm,
            on_outcome=lambda url, outcome: metrics.child(metrics.kv_events, url, outcome).inc(),
            on_lag=lambda url, s: metrics.child(metrics.kv_event_lag, url).set(s),
        )
        self.tokens = PrefixTokens(
            store,
            client,
            self.reprewarm,
            lambda: sorted(u for u, b in pool.backends.items() if b.healthy),
            model=model,
        )
        store.watch(self.tokens.wake)
        pool.watch(lambda _table: self.tokens.wake())

    def start(self) -> asyncio.Task[None]:
        """The token-id task (the caller owns it); the subscriber follows set_pods()."""
        self.tokens.wake()
        return asyncio.create_task(self.tokens.run(), name="prefix-token-ids")

    def set_pods(self, urls: Iterable[str]) -> None:
        self.subscriber.set_pods(urls)

    async def stop(self) -> None:
        await self.subscriber.stop()
        self.reprewarm.stop()
