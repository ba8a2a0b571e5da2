"""Relay one completion stream from a pod to the caller, failing over before the first token.

Before the first token nothing has reached the caller, so a refused connection, a timeout,
a 5xx, a 429, a broken or malformed stream moves the request to the next pod in preference
order: nothing that could have been retried is lost. After the first token the text already
sent stands and the stream ends with UNAVAILABLE, saying it is partial: replaying the
request elsewhere would duplicate text the caller has already shown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import grpc

from sidecar.membership.health import HealthMonitor
from sidecar.membership.pool import BackendPool
from sidecar.metrics import Metrics
from sidecar.upstream.body import SplicedBody
from sidecar.upstream.client import UpstreamClient, UpstreamError, UpstreamStream
from sidecar.upstream.sse import Delta, usage_counts
from sidecar.v1 import router_pb2

logger = logging.getLogger("sidecar.requests")

# Less time than this left after the last attempt means the deadline ended the request.
DEADLINE_SLACK_S = 0.01


# A stream that ends with [DONE] but never said why it finished was cut short by the pod
# (llama.cpp's server does this when another request arrives, for example).
TRUNCATED = "the stream ended without a finish_reason: the pod cut it short"


class RelayAbort(Exception):
    """End the RPC with this status and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class RelayOutcome:
    backend: str = ""
    attempts: int = 0
    status: str = "OK"
    ttft_s: float | None = None
    usage: tuple[int, int, int] = (0, 0, 0)
    errors: list[str] = field(default_factory=list)


@dataclass
class RelayPolicy:
    max_attempts: int
    first_token_timeout_s: float
    upstream_timeout_s: float


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

    async def stream(
        self,
        candidates: list[str],
        path: str,
        body: bytes | SplicedBody,
        *,
        chat: bool,
        time_remaining: Callable[[], float | None],
        outcome: RelayOutcome,
        on_accepted: Callable[[], None] | None = None,
    ) -> AsyncGenerator[router_pb2.Chunk, None]:
        """Yield the chunks of the first pod that streams; `on_accepted` is called when a
        pod first answers 200 (the caller can send its response headers then)."""
        started = time.perf_counter()
        attempts = candidates[: self.policy.max_attempts]
        for number, backend in enumerate(attempts, 1):
            outcome.backend = backend
            outcome.attempts = number
            remaining = time_remaining()
            if remaining is not None and remaining <= 0:
                break
            budget = self._first_token_budget(remaining, len(attempts) - number)
            self.pool.acquire(backend)
            self.metrics.child(self.metrics.in_flight, backend).inc()
            stream: UpstreamStream | None = None
            sent_first = False
            try:
                try:
                    async with asyncio.timeout(budget):
                        stream = await self.client.open(
                            backend,
                            path,
                            body,
                            timeout_s=self._total_timeout(remaining),
                            chat=chat,
                        )
                        if on_accepted is not None:
                            on_accepted()
                            on_accepted = None
                        first = await stream.next_delta()
                        while not (first.text or first.done or first.finish_reason):
                            first.merge(await stream.next_delta())
                except TimeoutError:
                    raise UpstreamError(
                        backend, f"no first token within {budget:.3g} s", retryable=True
                    ) from None
                finish_reason = first.finish_reason
                if first.done and not finish_reason and not first.text:
                    raise UpstreamError(backend, TRUNCATED, retryable=True)
                outcome.ttft_s = time.perf_counter() - started
                self.metrics.child(self.metrics.ttft, backend).observe(outcome.ttft_s)
                sent_first = True
                yield self._chunk(first, backend=backend, attempts=number, outcome=outcome)
                while not stream.finished:
                    delta = await stream.next_delta()
                    finish_reason = delta.finish_reason or finish_reason
                    if delta.text or delta.finish_reason or delta.usage is not None:
                        yield self._chunk(delta, outcome=outcome)
                if not finish_reason:
                    raise UpstreamError(backend, TRUNCATED, retryable=True)
                if self.health is not None:
                    self.health.record_success(backend)
                return
            except UpstreamError as exc:
                outcome.errors.append(str(exc))
                if exc.connection_failure and self.health is not None:
                    self.health.record_failure(backend, exc.message)
                if sent_first:
                    outcome.status = "PARTIAL"
                    remaining = time_remaining()
                    expired = remaining is not None and remaining < DEADLINE_SLACK_S
                    raise RelayAbort(
                        grpc.StatusCode.DEADLINE_EXCEEDED
                        if expired
                        else grpc.StatusCode.UNAVAILABLE,
                        f"the stream from {backend} broke after the first token "
                        f"({exc.message}); the text already sent is partial - retry the "
                        "request if you need the whole answer",
                    ) from None
                if not exc.retryable:
                    outcome.status = "INVALID_ARGUMENT"
                    raise RelayAbort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"the pod {backend} rejected the request: {exc.message}",
                    ) from None
                reason = f"http_{exc.status}" if exc.status else "connection"
                self.metrics.failovers.labels(backend, reason).inc()
                # The pod's own words may repeat the prompt: INFO gets the class only.
                logger.info(
                    "attempt %d on %s failed before the first token (%s)", number, backend, reason
                )
                logger.debug("attempt %d on %s failed: %s", number, backend, exc.message)
            finally:
                if stream is not None:
                    stream.close()
                self.pool.release(backend)
                self.metrics.child(self.metrics.in_flight, backend).dec()
        outcome.status = "UNAVAILABLE"
        if not outcome.errors:
            raise RelayAbort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the deadline expired before any pod could be tried",
            )
        remaining = time_remaining()
        if remaining is not None and remaining < DEADLINE_SLACK_S:
            # The last attempt's timeouts were the caller's deadline: say so, whichever
            # timer (ours or aiohttp's) fired first.
            raise RelayAbort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the deadline expired after {len(outcome.errors)} attempt(s): "
                + "; ".join(outcome.errors),
            )
        raise RelayAbort(
            grpc.StatusCode.UNAVAILABLE,
            f"no pod could serve the request after {len(outcome.errors)} attempt(s): "
            + "; ".join(outcome.errors),
        )

    def _first_token_budget(self, remaining: float | None, attempts_left: int) -> float:
        """Leave time for the pods after this one: a stalled pod must not eat the deadline."""
        budget = self.policy.first_token_timeout_s
        if remaining is not None:
            share = remaining / 2 if attempts_left > 0 else remaining
            budget = min(budget, share)
        return max(budget, 0.001)

    def _total_timeout(self, remaining: float | None) -> float:
        if remaining is None:
            return self.policy.upstream_timeout_s
        return min(remaining, self.policy.upstream_timeout_s)

    @staticmethod
    def _chunk(
        delta: Delta, *, outcome: RelayOutcome, backend: str = "", attempts: int = 0
    ) -> router_pb2.Chunk:
        chunk = router_pb2.Chunk(
            text=delta.text,
            backend=backend,
            finish_reason=delta.finish_reason,
            attempts=attempts,
        )
        if delta.usage is not None:
            prompt, completion, cached = usage_counts(delta.usage)
            outcome.usage = (prompt, completion, cached)
            chunk.usage.CopyFrom(
                router_pb2.Usage(
                    prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
                )
            )
        return chunk
