"""A pod's SSE answer read as deltas: the gRPC front's side of an answer.

The decoder (prefix_sidecar.upstream.sse) gets the bytes in the pieces the socket gives, and
hands back at most one slice of events per call so a fast pod cannot hold the event loop.
A stream that ended with [DONE] is recycled (its connection kept once the body's end is
read); any other is closed, which ends the pod's request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from prefix_sidecar.upstream.answer import read_from
from prefix_sidecar.upstream.errors import UpstreamError
from prefix_sidecar.upstream.lean_http import PodAnswer
from prefix_sidecar.upstream.sse import Delta, SSEDecoder, SSEProtocolError, clip


class UpstreamStream:
    """One open streaming answer; iterate for coalesced deltas."""

    def __init__(
        self,
        backend: str,
        answer: PodAnswer,
        chat: bool,
        redact: Callable[[str], str],
        recycle: Callable[[PodAnswer], None],
        *,
        raw_events: bool = False,
    ) -> None:
        self.backend = backend
        self._redact = redact
        self._recycle = recycle
        self._answer = answer
        self._decoder = SSEDecoder(chat=chat, raw=raw_events)
        self.finished = False

    async def next_delta(self) -> Delta:
        """Wait for the next read from the pod and return the events it completed (at most
        one decoder slice: a fast pod must not hold the event loop)."""
        while True:
            if self._decoder.pending_error:
                raise UpstreamError(self.backend, self._decoder.pending_error, retryable=True)
            if self._decoder.backlog:
                # More is buffered than one slice: let other streams and calls run first
                # (a read does not yield while data is buffered).
                await asyncio.sleep(0)
                data = b""
            else:
                data = await self._read()
            try:
                delta = self._decoder.feed(data)
            except SSEProtocolError as exc:
                raise UpstreamError(self.backend, str(exc), retryable=True) from None
            if delta.error:
                message = f"the pod reported an error: {clip(self._redact(delta.error))}"
                if not (delta.text or delta.finish_reason):
                    raise UpstreamError(self.backend, message, retryable=True)
                self._decoder.pending_error = message  # after relaying the text before it
            if delta.events or delta.done:
                if delta.done:
                    self.finished = True
                return delta

    async def _read(self) -> bytes:
        data = await read_from(self._answer, self.backend, self._redact)
        if not data:
            raise UpstreamError(
                self.backend, "the pod closed the stream before [DONE]", retryable=True
            )
        return data

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while not self.finished:
            yield await self.next_delta()

    def close(self) -> None:
        """Drop the connection unless the stream ended cleanly (then it is reusable)."""
        if self.finished:
            self._recycle(self._answer)
        else:
            self._answer.close()
