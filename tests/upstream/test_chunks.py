"""Chunks from one relayed Delta stay under the limit and keep the pod's bytes."""

from __future__ import annotations

import pytest

from prefix_sidecar.upstream.chunks import EVENT_OVERHEAD, delta_chunks
from prefix_sidecar.upstream.sse import Delta
from prefix_sidecar.v1 import router_pb2


def joined_events(chunks: list[router_pb2.Chunk]) -> list[str]:
    """The events as the pod sent them: a piece whose Chunk says event_continues is joined
    with the first event of the next Chunk."""
    events: list[str] = []
    carry = False
    for chunk in chunks:
        pieces = list(chunk.events)
        if carry and pieces:
            events[-1] += pieces.pop(0)
        events += pieces
        carry = chunk.event_continues
    assert not carry
    return events


def test_a_small_delta_is_one_chunk_with_everything() -> None:
    delta = Delta(text="hi", finish_reason="stop", usage={"prompt_tokens": 3})
    delta.raw_events = ['{"a":1}', '{"b":2}']
    [chunk] = delta_chunks(delta, 4096, backend="http://pod", attempts=1)
    assert chunk.text == "hi" and list(chunk.events) == delta.raw_events
    assert chunk.backend == "http://pod" and chunk.finish_reason == "stop"
    assert chunk.usage.prompt_tokens == 3 and not chunk.event_continues


@pytest.mark.parametrize("char", ["x", "\u4e2d", "\U0001f600"])
def test_big_events_are_cut_between_characters_under_the_limit(char: str) -> None:
    limit = 1000
    events = [char * 3000, '{"small":1}', char * 999, "y" * (limit - EVENT_OVERHEAD)]
    delta = Delta(text=char * 700, finish_reason="stop", usage={"completion_tokens": 9})
    delta.raw_events = events
    chunks = delta_chunks(delta, limit, backend="http://pod", attempts=2)
    assert all(c.ByteSize() <= limit + 64 for c in chunks)  # + the fields set on first/last
    assert sum(len(e.encode()) + EVENT_OVERHEAD for e in chunks[1].events) <= limit
    assert joined_events(chunks) == events
    assert "".join(c.text for c in chunks) == delta.text
    assert chunks[0].backend == "http://pod" and chunks[0].attempts == 2
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 9
    assert not any(c.finish_reason for c in chunks[:-1])
