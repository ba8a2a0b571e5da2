"""gRPC Chunks from one relayed Delta, each under the message limit.

A Delta may hold more than one message can carry: a pod's huge text event, or, with
raw_events, the events' own JSON beside their text. The text is cut between characters; an
event's JSON is cut the same way and the Chunk that holds the cut says so
(event_continues), so a caller joins the pieces back into the pod's exact bytes.
- Complexity: O(bytes) per Delta; the common small Delta is one Chunk without encoding.
"""

from __future__ import annotations

from prefix_sidecar.upstream.sse import Delta, usage_counts
from prefix_sidecar.v1 import router_pb2

# A repeated string's tag and length prefix, rounded up.
EVENT_OVERHEAD = 8
# The smallest piece of an event worth starting in a Chunk (a UTF-8 character is <= 4 bytes).
MIN_EVENT_PIECE = 4


def delta_chunks(
    delta: Delta,
    limit: int,
    *,
    backend: str = "",
    attempts: int = 0,
) -> list[router_pb2.Chunk]:
    """One Chunk, or several when the text and events are over `limit` bytes: the backend
    and attempts go on the first, the finish reason and usage on the last."""
    bound = len(delta.text) * 4 + sum(len(e) * 4 + EVENT_OVERHEAD for e in delta.raw_events)
    if bound <= limit:  # the common case, without encoding anything
        chunks = [router_pb2.Chunk(text=delta.text, events=delta.raw_events)]
    else:
        chunks = [router_pb2.Chunk(text=piece) for piece in split_utf8(delta.text, limit)]
        chunks += _event_chunks(delta.raw_events, limit)
    chunks = [chunk for chunk in chunks if chunk.text or chunk.events] or [router_pb2.Chunk()]
    first, last = chunks[0], chunks[-1]
    first.backend, first.attempts = backend, attempts
    last.finish_reason = delta.finish_reason
    if delta.usage is not None:
        prompt, completion, cached = usage_counts(delta.usage)
        last.usage.CopyFrom(
            router_pb2.Usage(
                prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
            )
        )
    return chunks


def _event_chunks(events: list[str], limit: int) -> list[router_pb2.Chunk]:
    """The events packed in order into Chunks of at most `limit` bytes, an event too big
    for the room left cut between characters and continued in the next Chunk."""
    chunks = [router_pb2.Chunk()]
    room = limit
    for event in events:
        data = event.encode("utf-8")
        start = 0
        while start < len(data):
            take = room - EVENT_OVERHEAD
            end = _utf8_cut(data, start, take) if take >= MIN_EVENT_PIECE else start
            if end == start:  # no room for a character here: a new Chunk
                chunks.append(router_pb2.Chunk())
                room = limit
                continue
            chunks[-1].events.append(data[start:end].decode("utf-8"))
            room -= end - start + EVENT_OVERHEAD
            start = end
            if start < len(data):
                chunks[-1].event_continues = True
                chunks.append(router_pb2.Chunk())
                room = limit
    return chunks


def _utf8_cut(data: bytes, start: int, limit: int) -> int:
    """The largest end <= start + limit that does not cut a UTF-8 character of `data`."""
    end = min(start + limit, len(data))
    while start < end < len(data) and data[end] & 0xC0 == 0x80:  # a continuation byte
        end -= 1
    return end


def split_utf8(text: str, limit: int) -> list[str]:
    """text in pieces of at most `limit` UTF-8 bytes, cut between characters."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return [text]
    pieces = []
    start = 0
    while start < len(data):
        end = _utf8_cut(data, start, limit)
        pieces.append(data[start:end].decode("utf-8"))
        start = end
    return pieces
