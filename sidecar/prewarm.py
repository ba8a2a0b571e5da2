"""Prewarm: put a prefix's KV cache on its pods before traffic needs it.

The note pre-warms with fire-and-forget POSTs; here each (prefix, pod) pair is a
`max_tokens=1` completion whose result is reported (one event per state change), retried
with exponential backoff, and bounded in concurrency so a warm-up of many prefixes does
not itself become the peak that saturates the fleet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from sidecar.prefixes import PrefixEntry
from sidecar.upstream.body import completion_body
from sidecar.upstream.client import UpstreamClient, UpstreamError
from sidecar.upstream.sse import usage_counts

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


class Prewarmer:
    def __init__(
        self,
        client: UpstreamClient,
        *,
        concurrency: int = 4,
        attempts: int = 3,
        backoff_s: float = 0.2,
        timeout_s: float = 120.0,
        model: str = "",
        on_result: Callable[[WarmEvent], None] | None = None,
    ) -> None:
        self._client = client
        self._slots = asyncio.Semaphore(concurrency)
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._timeout_s = timeout_s
        self._model = model
        self._on_result = on_result

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

    async def _warm(self, entry: PrefixEntry, url: str, emit: Callable[[WarmEvent], None]) -> bool:
        async with self._slots:
            for attempt in range(1, self._attempts + 1):
                started = time.perf_counter()
                emit(WarmEvent(url, entry.id, STARTED, attempt))
                try:
                    prompt, cached = await asyncio.wait_for(
                        self._complete(entry, url), timeout=self._timeout_s
                    )
                except (TimeoutError, UpstreamError) as exc:
                    error = str(exc) or f"timed out after {self._timeout_s} s"
                    last = attempt == self._attempts or (
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
                    if self._on_result is not None:
                        self._on_result(event)
                    if last:
                        # The pod's own words may echo the prefix: full text only at DEBUG.
                        logger.warning(
                            "prewarm of %s on %s failed: %s", entry.name, url, failure_class(exc)
                        )
                        logger.debug("prewarm of %s on %s failed: %s", entry.name, url, error)
                        return False
                    await asyncio.sleep(self._backoff_s * 2 ** (attempt - 1))
                    continue
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
                if self._on_result is not None:
                    self._on_result(event)
                return True
        return False  # pragma: no cover - attempts >= 1

    async def _complete(self, entry: PrefixEntry, url: str) -> tuple[int, int]:
        body = completion_body(entry.json_bytes, "", {"max_tokens": 1}, self._model)
        stream = await self._client.open(
            url, "/v1/completions", body, timeout_s=self._timeout_s, chat=False
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
