"""Relay one completion stream from a pod to the caller, failing over before the first token.

Before the first token nothing has reached the caller, so a refused connection, a timeout,
a 5xx, a 429, a broken or malformed stream moves the request to the next pod in preference
order: nothing that could have been retried is lost. After the first token the text already
sent stands and the stream ends with UNAVAILABLE, saying it is partial: replaying the
request elsewhere would duplicate text the caller has already shown.

Every Chunk fits a client's default 4 MiB receive limit and the server's send limit: a
longer text is split across chunks. An SSE event over the gRPC message limit before the
first token is a pod failure (the next pod is tried). What pods said in their errors is
clipped per attempt and in total, so the status always fits in gRPC's metadata limits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field

import grpc

from sidecar.membership.health import HealthMonitor
from sidecar.membership.pool import BackendPool
from sidecar.metrics import FRONT_GRPC, Metrics
from sidecar.server.abort import RpcAbort
from sidecar.server.caller import deadline_spent
from sidecar.server.chunks import delta_chunks
from sidecar.upstream.body import SplicedBody
from sidecar.upstream.client import UpstreamClient, UpstreamError, UpstreamStream
from sidecar.upstream.sse import Delta, clip, usage_counts
from sidecar.v1 import router_pb2

logger = logging.getLogger("sidecar.requests")

# gRPC's default max_receive_message_length on the client side.
CLIENT_RECEIVE_LIMIT = 4 * 1024 * 1024
# Room in a Chunk for everything but the text (backend url aside): field tags and lengths,
# a clipped finish_reason, attempts, usage.
CHUNK_OVERHEAD = 512
# A status message is sent as grpc-message metadata (percent-encoded): keep it well under
# the peer's 8 KiB metadata limit whatever the pods said.
REASON_BYTES = 600
STATUS_BYTES = 1900

# A stream that ends with [DONE] but never said why it finished was cut short by the pod
# (llama.cpp's server does this when another request arrives, for example).
TRUNCATED = "the stream ended without a finish_reason: the pod cut it short"


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
    max_message_bytes: int = 8 * 1024 * 1024  # the server's max_send_message_length


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
        headers: Mapping[str, str] | None = None,
        raw_events: bool = False,
    ) -> AsyncGenerator[router_pb2.Chunk, None]:
        """Yield the chunks of the first pod that streams; `on_accepted` is called when a
        pod first answers 200 (the caller can send its response headers then). `headers`
        are added to every attempt's HTTP request (the caller's trace context).
        `raw_events` adds each pod event's JSON text to the chunks.

        Raises RpcAbort with the status the call must end with when no pod streams, or when
        the stream breaks after the first token."""
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
                            headers=headers,
                            raw_events=raw_events,
                        )
                        if on_accepted is not None:
                            on_accepted()
                            on_accepted = None
                        first = await stream.next_delta()
                        # A tool call is an answer without text. Raw events held back before
                        # the first token are bounded to a Chunk's worth: past that they are
                        # sent (and the stream can no longer fail over).
                        held = self._text_limit(backend)
                        while not (
                            first.text
                            or first.done
                            or first.finish_reason
                            or first.tool_calls
                            or first.raw_bytes > held
                        ):
                            first.merge(await stream.next_delta())
                except TimeoutError:
                    raise UpstreamError(
                        backend, f"no first token within {budget:.3g} s", retryable=True
                    ) from None
                if first.largest_event > self.policy.max_message_bytes:
                    raise UpstreamError(
                        backend,
                        f"an SSE event of {first.largest_event} bytes is over the gRPC message "
                        f"limit (max_message_bytes {self.policy.max_message_bytes})",
                        retryable=True,
                    )
                finish_reason = first.finish_reason
                if first.done and not finish_reason and not first.text:
                    raise UpstreamError(backend, TRUNCATED, retryable=True)
                outcome.ttft_s = time.perf_counter() - started
                ttft = self.metrics.child(self.metrics.ttft, FRONT_GRPC, backend)
                ttft.observe(outcome.ttft_s)
                sent_first = True
                limit = self._text_limit(backend)
                for chunk in self._chunks(first, limit, outcome, backend=backend, attempts=number):
                    yield chunk
                while not stream.finished:
                    delta = await stream.next_delta()
                    finish_reason = delta.finish_reason or finish_reason
                    usage = delta.usage is not None
                    if delta.text or delta.finish_reason or usage or delta.raw_events:
                        for chunk in self._chunks(delta, limit, outcome):
                            yield chunk
                if not finish_reason:
                    raise UpstreamError(backend, TRUNCATED, retryable=True)
                if self.health is not None:
                    self.health.record_success(backend)
                return
            except UpstreamError as exc:
                outcome.errors.append(clip(str(exc), REASON_BYTES))
                if exc.connection_failure and self.health is not None:
                    self.health.record_failure(backend, exc.message)
                if sent_first:
                    outcome.status = "PARTIAL"
                    expired = deadline_spent(time_remaining())
                    raise RpcAbort(
                        grpc.StatusCode.DEADLINE_EXCEEDED
                        if expired
                        else grpc.StatusCode.UNAVAILABLE,
                        f"the stream from {backend} broke after the first token "
                        f"({exc.message}); the text already sent is partial - retry the "
                        "request if you need the whole answer",
                    ) from None
                if not exc.retryable:
                    outcome.status = "INVALID_ARGUMENT"
                    raise RpcAbort(
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
            raise RpcAbort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the deadline expired before any pod could be tried",
            )
        if deadline_spent(time_remaining()):
            # The last attempt's timeouts were the caller's deadline: say so, whichever
            # timer (ours or aiohttp's) fired first.
            raise RpcAbort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                clip(
                    f"the deadline expired after {len(outcome.errors)} attempt(s): "
                    + "; ".join(outcome.errors),
                    STATUS_BYTES,
                ),
            )
        raise RpcAbort(
            grpc.StatusCode.UNAVAILABLE,
            clip(
                f"no pod could serve the request after {len(outcome.errors)} attempt(s): "
                + "; ".join(outcome.errors),
                STATUS_BYTES,
            ),
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

    def _text_limit(self, backend: str) -> int:
        """UTF-8 bytes of text one Chunk may carry."""
        size = min(CLIENT_RECEIVE_LIMIT, self.policy.max_message_bytes)
        return max(size - CHUNK_OVERHEAD - len(backend.encode()), 256)

    @staticmethod
    def _chunks(
        delta: Delta, limit: int, outcome: RelayOutcome, *, backend: str = "", attempts: int = 0
    ) -> list[router_pb2.Chunk]:
        if delta.usage is not None:
            outcome.usage = usage_counts(delta.usage)
        return delta_chunks(delta, limit, backend=backend, attempts=attempts)
