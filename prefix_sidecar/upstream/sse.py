"""Incremental Server-Sent Events parsing for OpenAI-style streams (`data: {json}`).

Pure and I/O-free: feed bytes as they arrive, get the complete events coalesced into one Delta.
A pod's bytes are untrusted, so work is O(bytes) per stream and bounded: `_scan` remembers how
far lines were split (no byte searched twice) and consumed bytes are cut once per feed. One
feed() parses at most FEED_MAX_EVENTS events or FEED_MAX_BYTES bytes, then sets `backlog`: the
caller yields the event loop before feed(b""). An incomplete event over MAX_EVENT_BYTES is a
protocol error; pod text other than the completion is clipped. With `raw`, each event's JSON
text is also kept as sent (Delta.raw_events: tool calls, logprobs), one decode per event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DONE = b"[DONE]"
MAX_EVENT_BYTES = 16 * 1024 * 1024
# At ~3 us per tiny event one slice costs ~1 ms of the event loop.
FEED_MAX_EVENTS = 256
FEED_MAX_BYTES = 256 * 1024
# A pod's error text is kept this long until the client has redacted it (so a secret can
# never be cut in half), then clipped to POD_TEXT_BYTES for statuses and logs.
POD_ERROR_CHARS = 4096
POD_TEXT_BYTES = 500
FINISH_REASON_CHARS = 64


class SSEProtocolError(ValueError):
    """The pod sent something that is not a valid OpenAI SSE stream."""


@dataclass
class Delta:
    """What one or more SSE events added: text, a finish reason, usage, or the end."""

    text: str = ""
    finish_reason: str = ""
    usage: dict[str, Any] | None = None
    done: bool = False
    events: int = 0
    error: str = ""
    largest_event: int = 0  # bytes of the biggest event in this delta
    raw_events: list[str] = field(default_factory=list)  # with raw: each event's JSON text
    raw_bytes: int = 0  # their size, so a caller can bound what it holds
    tool_calls: bool = False  # a chat event carried tool calls (an answer without text)

    def merge(self, other: Delta) -> None:
        if other.text:
            self.text += other.text
        self.finish_reason = other.finish_reason or self.finish_reason
        self.usage = other.usage if other.usage is not None else self.usage
        self.done = self.done or other.done
        self.events += other.events
        self.error = self.error or other.error
        self.largest_event = max(self.largest_event, other.largest_event)
        if other.raw_events:
            self.raw_events += other.raw_events
            self.raw_bytes += other.raw_bytes
        self.tool_calls = self.tool_calls or other.tool_calls


class SSEDecoder:
    def __init__(self, chat: bool = False, raw: bool = False) -> None:
        self.chat = chat
        self.raw = raw
        self.pending_error = ""
        self.backlog = False  # the last feed stopped at its budget: call feed(b"") again
        self._buffer = bytearray()
        self._scan = 0  # no newline before this index is still unseen
        self._line_start = 0  # where the line being read began
        self._event_start = 0  # where the event being read began
        self._data: list[bytes] = []  # its `data:` lines so far

    def feed(self, data: bytes = b"") -> Delta:
        """Parse the complete events buffered, up to one slice; keep the incomplete tail."""
        buffer = self._buffer
        buffer += data
        delta = Delta()
        pieces: list[str] = []
        budget_end = self._scan + FEED_MAX_BYTES
        self.backlog = False
        try:
            while True:
                newline = buffer.find(b"\n", self._scan)
                if newline < 0:
                    self._scan = len(buffer)
                    self._check_size()
                    return delta
                start = self._line_start
                self._scan = self._line_start = newline + 1
                end = newline - 1 if newline > start and buffer[newline - 1] == 13 else newline
                if end > start:  # a field line; only `data:` matters here
                    if buffer.startswith(b"data:", start):
                        start += 6 if buffer.startswith(b" ", start + 5) else 5
                        self._data.append(bytes(buffer[start:end]))
                    self._check_size()
                    continue
                size = self._scan - self._event_start  # a blank line ends the event
                self._event_start = self._scan
                if not self._data:
                    continue  # comments (": keep-alive") and other fields
                payload = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
                self._data = []
                delta.largest_event = max(delta.largest_event, size)
                try:
                    self._event(payload, delta, pieces)
                except SSEProtocolError as exc:
                    if not (pieces or delta.finish_reason):
                        raise
                    # Relay the good events of this read first; the error comes next call.
                    self.pending_error = str(exc)
                    return delta
                if delta.done or delta.error:
                    return delta
                if delta.events >= FEED_MAX_EVENTS or self._scan >= budget_end:
                    self.backlog = self._scan < len(buffer)
                    return delta
        finally:
            if pieces:
                delta.text = "".join(pieces)
            if self._event_start:  # cut what is consumed: O(1) amortized at the front
                del buffer[: self._event_start]
                self._scan -= self._event_start
                self._line_start -= self._event_start
                self._event_start = 0

    def _check_size(self) -> None:
        if self._scan - self._event_start > MAX_EVENT_BYTES:
            raise SSEProtocolError(f"SSE event larger than {MAX_EVENT_BYTES} bytes")

    def _event(self, payload: bytes, delta: Delta, pieces: list[str]) -> None:
        if payload.strip() == DONE:
            delta.done = True
            return
        try:
            raw_text = payload.decode("utf-8") if self.raw else ""
            event = json.loads(raw_text or payload)
        except ValueError as exc:
            raise SSEProtocolError(f"malformed JSON in an SSE event: {exc}") from None
        if not isinstance(event, dict):
            raise SSEProtocolError("an SSE event is not a JSON object")
        delta.events += 1
        if "error" in event and not event.get("choices"):
            error = event["error"]
            message = error.get("message") if isinstance(error, dict) else error
            delta.error = _valid_text(str(message)[:POD_ERROR_CHARS])
            return
        if self.raw:
            delta.raw_events.append(raw_text)
            delta.raw_bytes += len(payload)
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                raise SSEProtocolError("a choice in an SSE event is not a JSON object")
            if self.chat:
                said = choice.get("delta")
                said = said if isinstance(said, dict) else {}
                piece = said.get("content")
                delta.tool_calls = delta.tool_calls or bool(said.get("tool_calls"))
            else:
                piece = choice.get("text")
            if isinstance(piece, str) and piece:
                pieces.append(_valid_text(piece))
            if choice.get("finish_reason"):
                reason = str(choice["finish_reason"])[:FINISH_REASON_CHARS]
                delta.finish_reason = _valid_text(reason)
        usage = event.get("usage")
        if isinstance(usage, dict):
            delta.usage = usage


def clip(text: str, max_bytes: int = POD_TEXT_BYTES) -> str:
    """At most max_bytes of UTF-8 (cut on a character boundary, marked with '...'): what
    a pod said must not grow a gRPC status past the metadata limit, or a log line."""
    if len(text) * 4 <= max_bytes:
        return text
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text
    return data[: max(0, max_bytes - 3)].decode("utf-8", "ignore") + "..."


def _valid_text(text: str) -> str:
    """JSON may carry a lone surrogate ("\\ud800"), which no protobuf string can hold:
    replace it with U+FFFD instead of failing the whole stream."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _count(value: Any) -> int:
    """A token count as a uint32; a pod's garbage (text, negative, huge) counts as 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    if not 0 <= value < 2**32:  # also false for NaN
        return 0
    return int(value)


def usage_counts(usage: dict[str, Any] | None) -> tuple[int, int, int]:
    """(prompt_tokens, completion_tokens, cached_tokens) from an OpenAI/vLLM usage object."""
    if not usage:
        return 0, 0, 0
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return (
        _count(usage.get("prompt_tokens")),
        _count(usage.get("completion_tokens")),
        _count(cached),
    )
