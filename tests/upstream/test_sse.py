"""The SSE decoder on its own: what one read of bytes from a pod turns into."""

from __future__ import annotations

import json
import math
import time

import pytest

from prefix_sidecar.upstream import sse
from prefix_sidecar.upstream.sse import SSEDecoder, SSEProtocolError, usage_counts


def event(text: str = "", finish: str | None = None, usage: dict | None = None) -> bytes:
    body: dict = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        body = {"choices": [], "usage": usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def test_everything_buffered_in_one_read_is_one_delta() -> None:
    decoder = SSEDecoder()
    delta = decoder.feed(event("a") + event("b") + event("c", "length"))
    assert (delta.text, delta.finish_reason, delta.events) == ("abc", "length", 3)


def test_an_event_split_across_reads_waits_for_its_end() -> None:
    decoder = SSEDecoder()
    data = event("hello")
    assert decoder.feed(data[:7]).events == 0
    assert decoder.feed(data[7:]).text == "hello"


def test_crlf_comments_usage_and_done() -> None:
    decoder = SSEDecoder()
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    data = b": keep-alive\r\n\r\n" + event("x").replace(b"\n\n", b"\r\n\r\n") + event(usage=usage)
    delta = decoder.feed(data + b"data: [DONE]\n\n")
    assert delta.text == "x" and delta.done
    assert usage_counts(delta.usage) == (10, 2, 8)


def test_chat_deltas_read_content() -> None:
    decoder = SSEDecoder(chat=True)
    chunk = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}}]}
    assert decoder.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n").text == "hi"


def test_malformed_json_before_any_text_raises() -> None:
    with pytest.raises(SSEProtocolError, match="malformed JSON"):
        SSEDecoder().feed(b"data: {not json\n\n")


def test_good_events_before_a_malformed_one_are_kept_and_the_error_follows() -> None:
    decoder = SSEDecoder()
    delta = decoder.feed(event("kept ") + event("text") + b"data: {broken\n\n")
    assert delta.text == "kept text"
    assert "malformed JSON" in decoder.pending_error


TINY = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'


def _feed_all(data: bytes) -> tuple[int, float]:
    """(text length, seconds) to decode `data` given as one read, slices included."""
    decoder = SSEDecoder()
    started = time.perf_counter()
    length = len(decoder.feed(data).text)
    while getattr(decoder, "backlog", False):
        length += len(decoder.feed(b"").text)
    return length, time.perf_counter() - started


def test_feed_is_linear_in_bytes() -> None:
    """4x the tiny events in one read costs ~4x, not ~16x (the old decoder rescanned and
    copied the rest of the buffer once per event). Best of 5 against a noisy machine."""
    small, large = TINY * 2_000, TINY * 8_000
    times = {}
    for name, data in (("small", small), ("large", large)):
        best = math.inf
        for _ in range(5):
            length, seconds = _feed_all(data)
            assert length == len(data) // len(TINY)
            best = min(best, seconds)
            assert seconds < 10, "a feed of 0.5 MiB must not take seconds"
        times[name] = best
    assert times["large"] / times["small"] < 8, times


def test_one_huge_read_is_parsed_in_bounded_slices() -> None:
    """A 1 MiB read is not parsed in one go: each feed() stops after a bounded slice and
    says so (`backlog`), so the relay can give the event loop back in between."""
    data = TINY * (1024 * 1024 // len(TINY))
    decoder = SSEDecoder()
    delta = decoder.feed(data)
    assert 0 < delta.events <= sse.FEED_MAX_EVENTS and decoder.backlog
    total, calls = len(delta.text), 1
    while decoder.backlog:
        delta = decoder.feed(b"")
        assert delta.events <= sse.FEED_MAX_EVENTS
        total, calls = total + len(delta.text), calls + 1
    assert (
        total == len(data) // len(TINY) and calls >= len(data) // len(TINY) // sse.FEED_MAX_EVENTS
    )


def test_events_split_anywhere_across_reads() -> None:
    stream = TINY * 3 + b": ping\r\n\r\n" + event("y").replace(b"\n", b"\r\n") + b"data: [DONE]\n\n"
    decoder, text, done = SSEDecoder(), "", False
    for index in range(len(stream)):
        delta = decoder.feed(stream[index : index + 1])
        text, done = text + delta.text, done or delta.done
    assert (text, done) == ("xxxy", True)


def test_a_field_flood_without_a_blank_line_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines that never end an event count towards the event size limit too."""
    monkeypatch.setattr(sse, "MAX_EVENT_BYTES", 4096)
    decoder = SSEDecoder()
    with pytest.raises(SSEProtocolError, match="larger than"):
        for _ in range(1000):
            decoder.feed(b"data: more\n")


def test_pod_texts_are_clipped() -> None:
    huge = json.dumps({"error": {"message": "e" * 100_000}}).encode()
    delta = SSEDecoder().feed(b"data: " + huge + b"\n\n")
    assert len(delta.error) <= sse.POD_ERROR_CHARS
    reason = {"choices": [{"text": "a", "finish_reason": "f" * 10_000}]}
    delta = SSEDecoder().feed(b"data: " + json.dumps(reason).encode() + b"\n\n")
    assert len(delta.finish_reason) <= sse.FINISH_REASON_CHARS
    assert len(sse.clip("\u4e2d" * 1000, 500).encode()) <= 500
    assert sse.clip("short") == "short"


def test_raw_mode_keeps_each_events_json_text_as_sent() -> None:
    sent = [
        '{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1"}]}}] ,"x":1.0e-3}',
        '{"choices":[{"index":1,"delta":{"content":"\u4e2d"},"logprobs":{"content":[]}}]}',
    ]
    stream = b"".join(b"data: " + s.encode() + b"\r\n\r\n" for s in sent) + b"data: [DONE]\n\n"
    decoder = SSEDecoder(chat=True, raw=True)
    delta = decoder.feed(stream[:7])
    for i in range(7, len(stream), 5):
        delta.merge(decoder.feed(stream[i : i + 5]))
    assert delta.raw_events == sent and delta.done
    assert delta.text == "\u4e2d" and delta.tool_calls


def test_raw_mode_joins_multi_line_data_and_is_off_by_default() -> None:
    data = b'data: {"choices":\ndata: []}\n\n'
    assert SSEDecoder(raw=True).feed(data).raw_events == ['{"choices":\n[]}']
    assert SSEDecoder().feed(data).raw_events == []


def test_raw_mode_refuses_an_event_that_is_not_utf8() -> None:
    with pytest.raises(SSEProtocolError, match="malformed JSON"):
        SSEDecoder(raw=True).feed(b'data: {"text": "\xff"}\n\n')


def test_raw_mode_counts_the_bytes_it_keeps() -> None:
    delta = SSEDecoder(raw=True).feed(b'data: {"choices":[]}\n\ndata:{"a":1}\n\n')
    assert delta.raw_bytes == len('{"choices":[]}') + len('{"a":1}')
