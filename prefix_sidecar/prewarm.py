"""Prewarm: put a prefix's KV cache on its pods before traffic needs it.

Each (prefix, pod) pair is a `max_tokens=1` completion, reported per state change, retried
with jittered exponential backoff. Concurrency is bounded per pod, so a mass warm-up is not
itself the peak, and a slot is held for one attempt, never through a backoff: a wedged pod
(health OK, completions hang) ties up only its own slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field

from prefix_sidecar.config import DEFAULTS
from prefix_sidecar.prefixes import PrefixEntry
from prefix_sidecar.upstream.body import completion_body
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError
from prefix_sidecar.upstream.sse import usage_counts

# Per pod: a few prefills at once, leaving room for the joiner's own traffic.
CONCURRENCY = 4
# Tries, and the first retry pause (doubled each time, x U(0.5, 1.5)): a pod just up may
# refuse a request or two.
ATTEMPTS = 3
RETRY_BACKOFF_S = 0.2
TIMEOUT_S = 120.0  # per prewarm: bounds a hung pod, far above a prefill's seconds

logger = logging.getLogger(__name__)

STARTED = "STARTED"
WARMED = "WARMED"
FAILED = "FAILED"
RETRYING = "RETRYING"


@dataclass(frozen=True)
class WarmEvent:
    backend: str
    prefix_id: str
    state: str
    attempt: int
    elapsed_ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


@dataclass
class _PodSlots:
    semaphore: asyncio.Semaphore
    users: int = 0  # pairs holding or waiting for a slot; at 0 the entry is dropped


@dataclass(eq=False)
class Prewarmer:
    client: UpstreamClient
    _: KW_ONLY
    concurrency: int = CONCURRENCY  # per pod
    attempts: int = ATTEMPTS
    backoff_s: float = RETRY_BACKOFF_S
    timeout_s: float = TIMEOUT_S
    model: str = DEFAULTS.model
    # Per pod; only pods with pairs in progress.
    _slots: dict[str, _PodSlots] = field(default_factory=dict, init=False)

    async def run(self, pairs: Sequence[tuple[PrefixEntry, str]]) -> AsyncIterator[WarmEvent]:
        """Warm every (prefix, pod) pair; yield events as they happen."""
        queue: asyncio.Queue[WarmEvent | None] = asyncio.Queue()
        tasks = [
            asyncio.create_task(self._warm(entry, url, queue.put_nowait)) for entry, url in pairs
        ]

        async def finish() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)
            queue.put_nowait(None)

        closer = asyncio.create_task(finish())
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            for task in tasks:
                task.cancel()
            closer.cancel()

    async def warm_all(self, pairs: Sequence[tuple[PrefixEntry, str]]) -> list[WarmEvent]:
        """Warm and return only the final event of each pair."""
        final = []
        async for event in self.run(pairs):
            if event.state in (WARMED, FAILED):
                final.append(event)
        return final

    @contextlib.asynccontextmanager
    async def _slot(self, url: str) -> AsyncIterator[None]:
        """One of the pod's `concurrency` slots, for one attempt."""
        slots = self._slots.get(url)
        if slots is None:
            slots = self._slots[url] = _PodSlots(asyncio.Semaphore(self.concurrency))
        slots.users += 1
        try:
            async with slots.semaphore:
                yield
        finally:
            slots.users -= 1
            if slots.users == 0:
                del self._slots[url]  # pod IPs churn: keep no state for idle pods

    def _backoff(self, attempt: int) -> float:
        """Exponential, with jitter so that many pairs failing together do not retry in step."""
        return float(self.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))

    async def _warm(self, entry: PrefixEntry, url: str, emit: Callable[[WarmEvent], None]) -> None:
        for attempt in range(1, self.attempts + 1):
            async with self._slot(url):
                started = time.perf_counter()
                emit(WarmEvent(url, entry.id, STARTED, attempt))
                try:
                    prompt, cached = await asyncio.wait_for(
                        self._complete(entry, url), timeout=self.timeout_s
                    )
                except (TimeoutError, UpstreamError) as exc:
                    error = str(exc) or f"timed out after {self.timeout_s} s"
                    last = attempt == self.attempts or (
                        isinstance(exc, UpstreamError) and not exc.retryable
                    )
                    event = WarmEvent(
                        url,
                        entry.id,
                        FAILED if last else RETRYING,
                        attempt,
                        elapsed_ms=(time.perf_counter() - started) * 1e3,
                        error=error,
                    )
                    emit(event)
                    if last:
                        # The pod's own words may echo the prefix: full text only at DEBUG.
                        logger.warning(
                            "prewarm of %s on %s failed: %s", entry.name, url, failure_class(exc)
                        )
                        logger.debug("prewarm of %s on %s failed: %s", entry.name, url, error)
                        return
                else:
                    event = WarmEvent(
                        url,
                        entry.id,
                        WARMED,
                        attempt,
                        elapsed_ms=(time.perf_counter() - started) * 1e3,
                        prompt_tokens=prompt,
                        cached_tokens=cached,
                    )
                    emit(event)
                    return
            # The slot is free during the backoff: the pod's other pairs go on meanwhile.
            await asyncio.sleep(self._backoff(attempt))

    async def _complete(self, entry: PrefixEntry, url: str) -> tuple[int, int]:
        # The prefix is sent as registered, trailing whitespace included: BPE pre-tokenizers
        # split where whitespace begins, so this warms every block the stripped text would,
        # plus the whitespace's when the query keeps that token. A query starting with a
        # letter absorbs a trailing space into its first word; only token ids (the request
        # path) can warm that block. Check on vLLM: python -m prefix_sidecar_tools.vllm.boundary.
        # A prefix registered for an adapter or a salt is warmed under them (contract 10).
        adapter, salt = entry.scope
        params: dict[str, object] = {"max_tokens": 1, **({"cache_salt": salt} if salt else {})}
        body = completion_body(entry.json_bytes, "", params, adapter or self.model)
        stream = await self.client.open(
            url, "/v1/completions", body, timeout_s=self.timeout_s, chat=False
        )
        try:
            usage = None
            async for delta in stream:
                usage = delta.usage or usage
        finally:
            stream.close()
        prompt, _, cached = usage_counts(usage)
        return prompt, cached


def failure_class(exc: BaseException) -> str:
    """A log-safe name for a failure: no text the pod sent back."""
    if isinstance(exc, UpstreamError):
        return f"http_{exc.status}" if exc.status else "connection or stream error"
    return "timed out" if isinstance(exc, asyncio.TimeoutError) else exc.__class__.__name__
