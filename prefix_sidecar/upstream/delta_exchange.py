"""The gRPC front's side of the relay's attempt loop (relay.py): the pod's SSE decoded into
deltas and sent as Chunks; what ends a call, as a gRPC status.

Every Chunk fits a client's default 4 MiB receive limit and the server's send limit (longer
text is split). An SSE event over the message limit before the first token is a pod failure
(the next pod is tried). Pods' error words are clipped in total to fit gRPC metadata limits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field

import grpc

from prefix_sidecar.abort import RpcAbort
from prefix_sidecar.upstream.body import SplicedBody
from prefix_sidecar.upstream.chunks import delta_chunks
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError
from prefix_sidecar.upstream.outcome import RelayOutcome
from prefix_sidecar.upstream.sse import Delta, clip, usage_counts
from prefix_sidecar.upstream.stream import UpstreamStream
from prefix_sidecar.v1 import router_pb2

# gRPC's default max_receive_message_length on the client side.
CLIENT_RECEIVE_LIMIT = 4 * 1024 * 1024
# Room in a Chunk for everything but the text (backend url aside): field tags and lengths,
# a clipped finish_reason, attempts, usage.
CHUNK_OVERHEAD = 512
# A status message is sent as grpc-message metadata (percent-encoded): keep it well under
# the peer's 8 KiB metadata limit whatever the pods said.
STATUS_BYTES = 1900

# A stream that ends with [DONE] but never said why it finished was cut short by the pod
# (llama.cpp's server does this when another request arrives, for example).
TRUNCATED = "the stream ended without a finish_reason: the pod cut it short"


@dataclass(eq=False)
class DeltaExchange:
    """The gRPC front's exchange: the pod's SSE decoded into deltas, sent as Chunks."""

    client: UpstreamClient
    path: str
    body: bytes | SplicedBody
    _: KW_ONLY
    chat: bool
    outcome: RelayOutcome
    max_message_bytes: int
    on_accepted: Callable[[], None] | None
    headers: Mapping[str, str] | None
    raw_events: bool
    stream: UpstreamStream | None = field(default=None, init=False)
    finish_reason: str = field(default="", init=False)
    limit: int = field(default=0, init=False)

    async def first(self, backend: str, attempt: int, timeout_s: float) -> list[router_pb2.Chunk]:
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
            raise UpstreamError(stream.backend, TRUNCATED, retryable=True)
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
            code, words = grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline expired"
        else:
            code, words = grpc.StatusCode.UNAVAILABLE, "no pod could serve the request"
        message = f"{words} after {len(errors)} attempt(s): " + "; ".join(errors)
        return RpcAbort(code, clip(message, STATUS_BYTES))

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
