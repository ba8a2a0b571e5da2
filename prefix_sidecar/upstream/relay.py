"""The relay: one attempt loop for both fronts, failing over before the first token.

Pods are tried in preference order. Before the first token nothing reached the caller, so a
pod's failure (prefix_sidecar.upstream.errors) moves the request on; a 4xx other than 429 is
the caller's and no retry can fix it. After the first token the answer ends marked partial:
replaying it elsewhere would duplicate text the caller has shown. Load counts, pod health, the
deadline and per-request metrics (front=grpc|http) are kept here, once.
Each front's Exchange says what is sent, what is the first token and how errors end a call
(delta_exchange.DeltaExchange, byte_relay.ByteExchange). Pods' words are clipped per attempt
here, in total by each front.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from prefix_sidecar.membership.health import HealthMonitor
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.metrics import Metrics
from prefix_sidecar.routing.cost import NO_PREFILL, Prefill
from prefix_sidecar.upstream.caller import deadline_spent
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError
from prefix_sidecar.upstream.outcome import RelayOutcome
from prefix_sidecar.upstream.sse import clip

logger = logging.getLogger("sidecar.requests")

# A pod's words about one failed attempt, clipped (the whole status: delta_exchange.py).
REASON_BYTES = 600

Item = TypeVar("Item")


@dataclass
class RelayPolicy:
    max_attempts: int
    first_token_timeout_s: float
    upstream_timeout_s: float
    max_message_bytes: int = 8 * 1024 * 1024  # the server's max_send_message_length


class Exchange(Protocol[Item]):
    """One front's side of an attempt: how a request goes to a pod and what comes back.

    `first` and `next` raise UpstreamError for a pod that fails (`retryable` or not); the
    loop decides what that means. The three error methods build the exception that ends
    the call, in the front's own shape."""

    async def first(self, backend: str, attempt: int, timeout_s: float) -> list[Item]:
        """Send, and return the answer's first items (the first token's)."""
        ...

    async def next(self) -> list[Item] | None:
        """The next items of the answer; None once it ended."""
        ...

    def close(self) -> None:
        """End this attempt's pod request (a finished one keeps its connection)."""
        ...

    def broken(self, backend: str, exc: UpstreamError, expired: bool) -> BaseException:
        """The pod failed after the first token: the answer sent so far is partial."""
        ...

    def rejected(self, backend: str, exc: UpstreamError, outcome: RelayOutcome) -> BaseException:
        """The pod refused the caller's request (a 4xx): no other pod would accept it."""
        ...

    def exhausted(self, errors: list[str], expired: bool) -> BaseException:
        """No pod answered (`errors`, one per attempt; none when the deadline came first)."""
        ...


class Relay:
    def __init__(
        self,
        client: UpstreamClient,
        pool: BackendPool,
        health: HealthMonitor | None,
        metrics: Metrics,
        policy: RelayPolicy,
    ) -> None:
        self.client = client
        self.pool = pool
        self.health = health
        self.metrics = metrics
        self.policy = policy

    async def attempts(
        self,
        candidates: list[str],
        exchange: Exchange[Item],
        *,
        front: str,
        outcome: RelayOutcome,
        time_remaining: Callable[[], float | None] = lambda: None,  # no deadline
        first_timeout_s: float | None = None,
        forced_first: bool = False,
        prefill: Prefill = NO_PREFILL,
    ) -> AsyncGenerator[Item, None]:
        """Yield the items of the first pod that answers, trying `candidates` in order.

        `front` labels the metrics; `outcome` gets the pod, attempts, TTFT and status.
        `first_timeout_s` replaces the first-token timeout (an unstreamed answer's first byte
        comes when it is done). `forced_first`: the first candidate was the key's only home
        (Decision.forced), counted apart from choices and failovers. `prefill`: the request's
        uncached prefill on each pod until its first token (Prefill.of(decision)).
        Raises the exchange's errors: broken, rejected or exhausted."""
        started = time.perf_counter()
        metrics, pool, health = self.metrics, self.pool, self.health
        tried = candidates[: self.policy.max_attempts]
        for number, backend in enumerate(tried, 1):
            outcome.backend = backend
            outcome.attempts = number
            remaining = time_remaining()
            if remaining is not None and remaining <= 0:
                break
            budget = self._first_token_budget(remaining, len(tried) - number, first_timeout_s)
            chosen = number > 1 or not forced_first
            uncached = pool.prefill_on(prefill, backend)
            pool.acquire(backend, chosen, uncached)
            computes, sent_at = uncached, pool.queues.sent(backend, uncached)
            in_flight = metrics.child(metrics.in_flight, front, backend)
            in_flight.inc()
            sent_first = False
            try:
                try:
                    async with asyncio.timeout(budget):
                        items = await exchange.first(
                            backend, number, self._total_timeout(remaining)
                        )
                except TimeoutError:
                    raise UpstreamError(
                        backend, f"no first token within {budget:.3g} s", retryable=True
                    ) from None
                outcome.ttft_s = time.perf_counter() - started
                metrics.child(metrics.ttft, front, backend).observe(outcome.ttft_s)
                sent_first = True
                pool.prefilled(backend, uncached, prefill.prefix_id)
                pool.queues.first_token(backend, computes, sent_at)
                uncached = 0
                for item in items:
                    yield item
                while (more := await exchange.next()) is not None:
                    for item in more:
                        yield item
                if health is not None:
                    health.record_success(backend)
                return
            except UpstreamError as exc:
                outcome.errors.append(clip(str(exc), REASON_BYTES))
                if exc.connection_failure and health is not None:
                    health.record_failure(backend, exc.message)
                if sent_first:
                    outcome.status = "PARTIAL"
                    raise exchange.broken(backend, exc, deadline_spent(time_remaining())) from None
                if not exc.retryable:
                    raise exchange.rejected(backend, exc, outcome) from None
                reason = f"http_{exc.status}" if exc.status else "connection"
                metrics.child(metrics.failovers, front, backend, reason).inc()
                # The pod's own words may repeat the prompt: INFO gets the class only.
                logger.info(
                    "attempt %d on %s failed before the first token (%s)", number, backend, reason
                )
                logger.debug("attempt %d on %s failed: %s", number, backend, exc.message)
            finally:
                exchange.close()
                pool.release(backend, chosen, uncached)
                if not sent_first:
                    pool.queues.dropped(backend, computes)
                in_flight.dec()
        outcome.status = "UNAVAILABLE"
        raise exchange.exhausted(outcome.errors, deadline_spent(time_remaining()))

    def _first_token_budget(
        self, remaining: float | None, attempts_left: int, first_timeout_s: float | None
    ) -> float:
        """Leave time for the pods after this one: a stalled pod must not eat the deadline."""
        budget = self.policy.first_token_timeout_s if first_timeout_s is None else first_timeout_s
        if remaining is not None:
            share = remaining / 2 if attempts_left > 0 else remaining
            budget = min(budget, share)
        return max(budget, 0.001)

    def _total_timeout(self, remaining: float | None) -> float:
        if remaining is None:
            return self.policy.upstream_timeout_s
        return min(remaining, self.policy.upstream_timeout_s)
