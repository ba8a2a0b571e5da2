"""The SSE decoder on its own: what one read of bytes from a pod turns into."""

from __future__ import annotations

import json

import pytest

from sidecar.upstream.sse import SSEDecoder, SSEProtocolError, usage_counts


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
