"""A sidecar's query of the shared block index (layout.py): which pods hold how much of a
chain of block keys, in one round trip (a script run in Redis) under a deadline. It is precise
routing's block source (routing.precise.BlockSource) with kv_index_url set: the prompt is keyed
at each block size the pods report, and each size is one query.

A hint, never a dependency: a query over its deadline, or Redis down, answers None and the
caller keeps its hash decision; after a failure Redis is not asked again for DOWN_S, so a dead
index costs a request nothing and a slow one the deadline at most. Outcomes, counted by the
caller: hit (some pod holds the first block), miss, timeout, down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from prefix_sidecar.config import Config
from prefix_sidecar.kv_events.precise import PreciseRouting
from prefix_sidecar.kv_index import layout
from prefix_sidecar.metrics import Metrics
from prefix_sidecar.routing.router import Router
from prefix_sidecar.upstream.client import UpstreamClient

logger = logging.getLogger(__name__)

DEADLINE_S = 0.005
DOWN_S = 1.0
SIZES_S = 5.0  # the pods' block sizes are read again after this
SIZES_UNKNOWN_S = 0.25  # or after this while none is known (a fleet starting)
MAX_BLOCK_SIZES = 4
MAX_FIELDS = 4096  # of one HGETALL read: a block held by more pods than this is not ours


class IndexLookup:
    """Longest cached prefixes from the index at `redis` (a redis.asyncio.Redis)."""

    def __init__(
        self,
        redis: Any,
        *,
        namespace: str = layout.DEFAULT_NAMESPACE,
        deadline_s: float = DEADLINE_S,
        on_outcome: Callable[[str], None] = lambda outcome: None,
    ) -> None:
        self.redis, self.namespace = redis, namespace
        self.deadline_s, self.on_outcome = deadline_s, on_outcome
        self._down_until = 0.0
        self._logged = False
        self._script = redis.register_script(layout.LONGEST_MATCH_LUA)
        self._sizes: tuple[float, set[int]] = (-SIZES_S, set())  # (read at, sizes)

    async def block_sizes(self) -> set[int]:
        """The block sizes the pods report (read at most every SIZES_S); none when the
        index did not answer."""
        read_at, sizes = self._sizes
        if time.monotonic() - read_at < (SIZES_S if sizes else SIZES_UNKNOWN_S):
            return sizes
        if time.monotonic() < self._down_until:
            return set()
        try:
            reply = await asyncio.wait_for(
                self.redis.hvals(layout.block_sizes_name(self.namespace)), self.deadline_s * 4
            )
        except (TimeoutError, OSError, RedisError):
            return set()
        self._sizes = (time.monotonic(), _block_sizes(reply))
        return self._sizes[1]

    async def matches(self, keys: list[int]) -> dict[str, int] | None:
        """Per pod, how many of `keys`' blocks it holds from the first on (pods holding
        none are absent); None when the index did not answer in time."""
        if not keys:
            return {}
        if time.monotonic() < self._down_until:
            self.on_outcome("down")
            return None
        args = layout.lookup_args(self.namespace, keys, MAX_FIELDS)
        try:
            replies = await asyncio.wait_for(
                self._script(keys=[layout.pods_name(self.namespace)], args=args), self.deadline_s
            )
        except TimeoutError:
            self.on_outcome("timeout")
            return None
        except (OSError, RedisError) as exc:
            self._down_until = time.monotonic() + DOWN_S
            if not self._logged:
                logger.warning("kv-index: %s; routing on hashes alone meanwhile", exc)
                self._logged = True
            self.on_outcome("down")
            return None
        self._logged = False
        found = _matches(replies, len(keys))
        self.on_outcome("hit" if found else "miss")
        return found

    async def longest(self, keys_at: Callable[[int], Sequence[int]]) -> dict[str, int] | None:
        found: dict[str, int] = {}
        for size in sorted(await self.block_sizes()):
            matches = await self.matches(list(keys_at(size)))
            if matches is None:
                return None
            # a pod holds blocks of its own size only
            found.update({pod: blocks * size for pod, blocks in matches.items()})
        return found

    async def close(self) -> None:
        await self.redis.aclose()


def attach_index(
    router: Router, client: UpstreamClient, metrics: Metrics, config: Config
) -> IndexLookup | None:
    """With kv_index_url and precise routing: the router's precise step reads the index."""
    if not config.kv_index_url or config.unregistered_routing != "precise":
        return None
    from redis.asyncio import Redis

    redis = Redis.from_url(config.kv_index_url, socket_connect_timeout=0.5, socket_timeout=0.5)
    lookup = IndexLookup(
        redis, on_outcome=lambda outcome: metrics.child(metrics.kv_index_queries, outcome).inc()
    )
    PreciseRouting.install(client, lookup, router, config, metrics)
    return lookup


def _block_sizes(reply: Any) -> set[int]:
    """HVALS of the block sizes, the plausible ones (the index is shared: untrusted)."""
    sizes: set[int] = set()
    for value in reply[:MAX_FIELDS] if isinstance(reply, list) else ():
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else ""
        if text.isascii() and text.isdigit() and 0 < int(text) <= 1 << 20:
            sizes.add(int(text))
    return set(sorted(sizes)[:MAX_BLOCK_SIZES])


def _matches(reply: Any, most: int) -> dict[str, int]:
    """The script's [pod, count, ...] as pod -> count; the index is shared, so untrusted:
    anything but that shape, bounded, is no match."""
    if not isinstance(reply, list) or len(reply) % 2 or len(reply) > 2 * MAX_FIELDS:
        return {}
    found: dict[str, int] = {}
    for pod, count in zip(reply[::2], reply[1::2], strict=True):
        try:
            blocks = int(count)
        except (TypeError, ValueError):
            return {}
        if isinstance(pod, bytes) and 0 < blocks <= most:
            found[pod.decode("utf-8", "replace")] = blocks
    return found
