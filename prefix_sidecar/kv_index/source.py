"""The shared index as precise routing's block source (routing.precise.BlockSource), and
its wiring into a sidecar with kv_index_url set: the prompt is keyed at each block size the
pods report, and each size is one lookup (lookup.py) under its deadline."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prefix_sidecar.config import Config
from prefix_sidecar.kv_events.precise import PreciseRouting
from prefix_sidecar.kv_index.lookup import IndexLookup
from prefix_sidecar.metrics import Metrics
from prefix_sidecar.routing.router import Router
from prefix_sidecar.upstream.client import UpstreamClient


class IndexSource:
    def __init__(self, lookup: IndexLookup) -> None:
        self.lookup = lookup

    async def block_sizes(self) -> set[int]:
        return await self.lookup.block_sizes() or set()

    async def longest(self, keys_at: Callable[[int], Sequence[int]]) -> dict[str, int] | None:
        found: dict[str, int] = {}
        for size in sorted(await self.lookup.block_sizes() or ()):
            matches = await self.lookup.matches(list(keys_at(size)))
            if matches is None:
                return None
            # a pod holds blocks of its own size only
            found.update({pod: blocks * size for pod, blocks in matches.items()})
        return found

    async def close(self) -> None:
        await self.lookup.redis.aclose()


def attach_index(
    router: Router, client: UpstreamClient, metrics: Metrics, config: Config
) -> IndexSource | None:
    """With kv_index_url and precise routing: the router's precise step reads the index."""
    if not config.kv_index_url or config.unregistered_routing != "precise":
        return None
    from redis.asyncio import Redis

    redis = Redis.from_url(config.kv_index_url, socket_connect_timeout=0.5, socket_timeout=0.5)
    lookup = IndexLookup(
        redis, on_outcome=lambda outcome: metrics.child(metrics.kv_index_queries, outcome).inc()
    )
    source = IndexSource(lookup)
    PreciseRouting.install(client, source, router, config, metrics)
    return source
