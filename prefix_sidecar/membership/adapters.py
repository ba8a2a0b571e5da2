"""Which LoRA adapters each pod of a pool holds, from the pods' own GET /v1/models.

vLLM lists its base model with `parent: null` and each adapter with its base as `parent`.
Pods of a pool may differ, so each is asked, a few per interval at the load signals' cadence
(longest-unasked first), bounded in time and bytes. Readers: routing/adapters.py (`holds`),
server/pools.py (the names). Untrusted: at most MAX_ADAPTERS_PER_POD names of at most
MAX_NAME_CHARS per pod, MAX_ADAPTERS in all; a silent pod keeps its last list until it leaves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import KW_ONLY, dataclass, field

from prefix_sidecar.membership.load_signals.poller import POLL_INTERVAL_S, POLL_SAMPLE
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError

logger = logging.getLogger(__name__)

TIMEOUT_S = 1.0
MAX_BYTES = 256 * 1024
MAX_ADAPTERS_PER_POD = 1024
MAX_ADAPTERS = 4096  # per pool: 4,096 names of 256 characters are ~1 MB
MAX_NAME_CHARS = 256


def adapters_listed(body: bytes) -> frozenset[str] | None:
    """The adapters (entries with a parent) of a /v1/models answer, bounded; None when the
    body is not a model list."""
    try:
        data = json.loads(body).get("data")
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(data, list):
        return None
    names = set()
    for item in data:
        if not isinstance(item, dict) or item.get("parent") is None:
            continue
        name = item.get("id")
        if isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS:
            names.add(name)
            if len(names) == MAX_ADAPTERS_PER_POD:
                break
    return frozenset(names)


@dataclass(eq=False)
class AdapterWatch:
    """The adapters each member pod holds, kept fresh by `run`."""

    client: UpstreamClient
    _: KW_ONLY
    interval_s: float = POLL_INTERVAL_S
    sample: int = POLL_SAMPLE
    _held: dict[str, frozenset[str]] = field(default_factory=dict, init=False)
    _asked: dict[str, float] = field(default_factory=dict, init=False)  # url -> when asked
    _names: frozenset[str] = field(default=frozenset(), init=False)

    def set_members(self, urls: Iterable[str]) -> None:
        wanted = set(urls)
        for url in [url for url in self._asked if url not in wanted]:
            del self._asked[url]
            self._held.pop(url, None)
        for url in wanted:
            self._asked.setdefault(url, 0.0)
        self._names = frozenset().union(*self._held.values())

    def holds(self, pod: str, adapter: str) -> bool:
        return adapter in self._held.get(pod, ())

    def of(self, pod: str) -> frozenset[str]:
        """The adapters `pod` was last seen holding."""
        return self._held.get(pod, frozenset())

    def __contains__(self, adapter: object) -> bool:
        return adapter in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def observe(self, url: str, adapters: frozenset[str]) -> None:
        """The pod's list as just read (a test, or `poll`)."""
        if url not in self._asked:
            return  # left the membership meanwhile
        others = frozenset().union(*(held for pod, held in self._held.items() if pod != url))
        room = MAX_ADAPTERS - len(others)
        new = sorted(adapters - others)
        if len(new) > room:
            adapters = (adapters & others) | frozenset(new[: max(room, 0)])
        if self._held.get(url) != adapters:
            self._held[url] = adapters
            self._names = others | adapters

    async def poll_once(self) -> None:
        oldest = sorted(self._asked, key=self._asked.__getitem__)[: self.sample]
        await asyncio.gather(*(self._poll(url) for url in oldest))

    async def _poll(self, url: str) -> None:
        self._asked[url] = time.monotonic()
        try:
            answer = await self.client.fetch(
                "GET", url, "/v1/models", timeout_s=TIMEOUT_S, limit=MAX_BYTES
            )
        except UpstreamError as exc:
            logger.debug("adapter poll of %s failed: %s", url, exc.message)
            return
        listed = adapters_listed(answer.body) if answer.status == 200 and answer.body else None
        if listed is not None:
            self.observe(url, listed)

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)
