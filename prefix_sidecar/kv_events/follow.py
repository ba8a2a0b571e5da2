"""kv_events=true in a running sidecar: each member's KV events feed the residency, and the
registered prefixes' token ids are kept current as prefixes and healthy pods change."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from prefix_sidecar.kv_events.prefix_tokens import PrefixTokens
from prefix_sidecar.kv_events.residency import Residency
from prefix_sidecar.kv_events.subscriber import KvEventSubscriber
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.metrics import Metrics
from prefix_sidecar.prefixes import PrefixStore
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
    ) -> None:
        self.subscriber = KvEventSubscriber(
            client,
            residency,
            on_outcome=lambda url, outcome: metrics.child(metrics.kv_events, url, outcome).inc(),
            on_lag=lambda url, s: metrics.child(metrics.kv_event_lag, url).set(s),
        )
        self.tokens = PrefixTokens(
            store,
            client,
            residency,
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
