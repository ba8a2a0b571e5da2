"""The relay: one attempt loop for both fronts, failing over before the first token.

Pods are tried in preference order. Before the first token nothing has reached the caller, so
a pod's failure (prefix_sidecar.upstream.errors: anything but a 4xx other than 429) moves the
request to the next pod; a 4xx is the caller's request: retrying cannot fix it. After the
first token the text already sent stands and the answer ends saying it is partial: replaying
the request elsewhere would duplicate text the caller has already shown. The pool's load
counts, the pods' health, the deadline and the per-request metrics (front=grpc|http) are
kept here, once.

What is sent and what counts as the first token is each front's Exchange: the gRPC front
decodes the pod's SSE into Chunks (DeltaExchange, below), the HTTP front relays the pod's
bytes (prefix_sidecar.upstream.byte_relay.ByteExchange). Each front also shapes the errors
that end a call: a gRPC status, or an HTTP status and an SSE error event.

Every gRPC Chunk fits a client's default 4 MiB receive limit and the server's send limit: a
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
from typing import Protocol, TypeVar

import grpc

from prefix_sidecar.abort import RpcAbort
from prefix_sidecar.membership.health import HealthMonitor
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.metrics import FRONT_GRPC, Metrics
from prefix_sidecar.upstream.body import SplicedBody
from prefix_sidecar.upstream.caller import deadline_spent
from prefix_sidecar.upstream.chunks import delta_chunks
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError
from prefix_sidecar.upstream.sse import Delta, clip, usage_counts
from prefix_sidecar.upstream.stream import UpstreamStream
from prefix_sidecar.v1 import router_pb2

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

Item = TypeVar("Item")


@dataclass
class RelayOutcome:
    pool: str = ""  # the pool the request's model picked ("": refused before that)
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
    ) -> AsyncGenerator[Item, None]:
        """Yield the items of the first pod that answers, trying `candidates` in order.

        `front` labels the metrics (FRONT_GRPC or FRONT_HTTP); `outcome` gets the pod, the
        attempts, the TTFT and the status. `first_timeout_s` replaces the first-token
        timeout (a whole, unstreamed answer's first byte comes when it is done).
        `forced_first`: the first candidate was the key's only home (Decision.forced); the
        pool counts it apart from choices and failovers. Raises the exchange's errors:
        broken, rejected or exhausted."""
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
            pool.acquire(backend, chosen)
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
                pool.release(backend, chosen)
                in_flight.dec()
        outcome.status = "UNAVAILABLE"
        raise exchange.exhausted(outcome.errors, deadline_spent(time_remaining()))

    def stream(
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
        forced_first: bool = False,
    ) -> AsyncGenerator[router_pb2.Chunk, None]:
        """The gRPC front's chunks of the first pod that streams; `on_accepted` is called
        when a pod first answers 200 (the caller can send its response headers then).
        `headers` are added to every attempt's HTTP request (the caller's trace context).
        `raw_events` adds each pod event's JSON text to the chunks.

        Raises RpcAbort with the status the call must end with when no pod streams, or when
        the stream breaks after the first token."""
        exchange = DeltaExchange(
            self.client,
            path,
            body,
            chat=chat,
            outcome=outcome,
            max_message_bytes=self.policy.max_message_bytes,
            on_accepted=on_accepted,
            headers=headers,
            raw_events=raw_events,
        )
        return self.attempts(
            candidates,
            exchange,
            front=FRONT_GRPC,
            outcome=outcome,
            time_remaining=time_remaining,
            forced_first=forced_first,
        )

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


class DeltaExchange:
    """The gRPC front's exchange: the pod's SSE decoded into deltas, sent as Chunks."""

    def __init__(
        self,
        client: UpstreamClient,
        path: str,
        body: bytes | SplicedBody,
        *,
        chat: bool,
        outcome: RelayOutcome,
        max_message_bytes: int,
        on_accepted: Callable[[], None] | None,
        headers: Mapping[str, str] | None,
        raw_events: bool,
    ) -> None:
        self.client = client
        self.path = path
        self.body = body
        self.chat = chat
        self.outcome = outcome
        self.max_message_bytes = max_message_bytes
        self.on_accepted = on_accepted
        self.headers = headers
        self.raw_events = raw_events
        self.stream: UpstreamStream | None = None
        self.backend = ""
        self.finish_reason = ""
        self.limit = 0

    async def first(self, backend: str, attempt: int, timeout_s: float) -> list[router_pb2.Chunk]:
        self.backend = backend
        self.stream = stream = await self.client.open(
            backend,
            self.path,
            self.body,
            timeout_s=timeout_s,
            chat=self.chat,
            headers=self.headers,
            raw_events=self.raw_events,
        )
        if self.on_accepted is not None:
            self.on_accepted()
            self.on_accepted = None
        self.limit = limit = self._text_limit(backend)
        first = await stream.next_delta()
        # A tool call is an answer without text. Raw events held back before the first
        # token are bounded to a Chunk's worth: past that they are sent (and the stream can
        # no longer fail over).
        while (
            not (first.text or first.done or first.finish_reason or first.tool_calls)
            and not first.raw_bytes > limit
        ):
            first.merge(await stream.next_delta())
        if first.largest_event > self.max_message_bytes:
            raise UpstreamError(
                backend,
                f"an SSE event of {first.largest_event} bytes is over the gRPC message "
                f"limit (max_message_bytes {self.max_message_bytes})",
                retryable=True,
            )
        self.finish_reason = first.finish_reason
        if first.done and not first.finish_reason and not first.text:
            raise UpstreamError(backend, TRUNCATED, retryable=True)
        return self._chunks(first, backend=backend, attempts=attempt)

    async def next(self) -> list[router_pb2.Chunk] | None:
        stream = self.stream
        assert stream is not None
        while not stream.finished:
            delta = await stream.next_delta()
            self.finish_reason = delta.finish_reason or self.finish_reason
            if delta.text or delta.finish_reason or delta.usage is not None or delta.raw_events:
                return self._chunks(delta)
        if not self.finish_reason:
            raise UpstreamError(self.backend, TRUNCATED, retryable=True)
        return None

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def broken(self, backend: str, exc: UpstreamError, expired: bool) -> BaseException:
        return RpcAbort(
            grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.UNAVAILABLE,
            f"the stream from {backend} broke after the first token "
            f"({exc.message}); the text already sent is partial - retry the "
            "request if you need the whole answer",
        )

    def rejected(self, backend: str, exc: UpstreamError, outcome: RelayOutcome) -> BaseException:
        outcome.status = "INVALID_ARGUMENT"
        return RpcAbort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the pod {backend} rejected the request: {exc.message}",
        )

    def exhausted(self, errors: list[str], expired: bool) -> BaseException:
        if not errors:
            return RpcAbort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the deadline expired before any pod could be tried",
            )
        if expired:
            # The last attempt's timeouts were the caller's deadline: say so, whichever
            # timer (ours or the client's) fired first.
            return RpcAbort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                clip(
                    f"the deadline expired after {len(errors)} attempt(s): " + "; ".join(errors),
                    STATUS_BYTES,
                ),
            )
        return RpcAbort(
            grpc.StatusCode.UNAVAILABLE,
            clip(
                f"no pod could serve the request after {len(errors)} attempt(s): "
                + "; ".join(errors),
                STATUS_BYTES,
            ),
        )

    def _text_limit(self, backend: str) -> int:
        """UTF-8 bytes of text one Chunk may carry."""
        size = min(CLIENT_RECEIVE_LIMIT, self.max_message_bytes)
        return max(size - CHUNK_OVERHEAD - len(backend.encode()), 256)

    def _chunks(
        self, delta: Delta, *, backend: str = "", attempts: int = 0
    ) -> list[router_pb2.Chunk]:
        if delta.usage is not None:
            self.outcome.usage = usage_counts(delta.usage)
        return delta_chunks(delta, self.limit, backend=backend, attempts=attempts)
