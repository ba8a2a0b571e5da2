"""Incremental Server-Sent Events parsing for OpenAI-style streams (`data: {json}`).

Pure and I/O-free (hypercorn's habit): feed bytes as they arrive, get back the complete
events in them. Everything that is already buffered comes back from one `feed`, which is
how the relay coalesces deltas into one gRPC message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DONE = "[DONE]"
MAX_EVENT_BYTES = 16 * 1024 * 1024


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

    def merge(self, other: Delta) -> None:
        self.text += other.text
        self.finish_reason = other.finish_reason or self.finish_reason
        self.usage = other.usage if other.usage is not None else self.usage
        self.done = self.done or other.done
        self.events += other.events
        self.error = self.error or other.error


@dataclass
class SSEDecoder:
    chat: bool = False
    pending_error: str = ""
    _buffer: bytes = field(default=b"", repr=False)

    def feed(self, data: bytes) -> Delta:
        """Parse every complete event in the buffer; keep the incomplete tail."""
        self._buffer += data
        delta = Delta()
        while True:
            end, skip = _event_end(self._buffer)
            if end < 0:
                if len(self._buffer) > MAX_EVENT_BYTES:
                    raise SSEProtocolError(f"SSE event larger than {MAX_EVENT_BYTES} bytes")
                return delta
            raw, self._buffer = self._buffer[:end], self._buffer[end + skip :]
            try:
                self._event(raw, delta)
            except SSEProtocolError as exc:
                if not (delta.text or delta.finish_reason):
                    raise
                # Relay the good events of this read first; the error comes on the next call.
                self.pending_error = str(exc)
                return delta
            if delta.done or delta.error:
                return delta

    def _event(self, raw: bytes, delta: Delta) -> None:
        lines = []
        for line in raw.split(b"\n"):
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                lines.append(line[5:].lstrip(b" "))
        if not lines:
            return  # comments (": keep-alive") and other fields
        payload = b"\n".join(lines)
        if payload.strip() == DONE.encode():
            delta.done = True
            return
        try:
            event = json.loads(payload)
        except ValueError as exc:
            raise SSEProtocolError(f"malformed JSON in an SSE event: {exc}") from None
        if not isinstance(event, dict):
            raise SSEProtocolError("an SSE event is not a JSON object")
        delta.events += 1
        if "error" in event and not event.get("choices"):
            error = event["error"]
            message = error.get("message") if isinstance(error, dict) else error
            delta.error = _valid_text(str(message))
            return
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                raise SSEProtocolError("a choice in an SSE event is not a JSON object")
            piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if isinstance(piece, str):
                delta.text += _valid_text(piece)
            if choice.get("finish_reason"):
                delta.finish_reason = _valid_text(str(choice["finish_reason"]))
        usage = event.get("usage")
        if isinstance(usage, dict):
            delta.usage = usage


def _event_end(buffer: bytes) -> tuple[int, int]:
    """Index of the first blank line ending an event, and its length."""
    candidates = [(buffer.find(sep), len(sep)) for sep in (b"\n\n", b"\r\n\r\n")]
    found = [(i, n) for i, n in candidates if i >= 0]
    return min(found) if found else (-1, 0)


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
