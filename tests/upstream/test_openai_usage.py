"""The usage of a relayed answer, read from its last bytes."""

from __future__ import annotations

import json

from prefix_sidecar.upstream.byte_usage import TAIL_BYTES, UsageTail

USAGE = {
    "prompt_tokens": 900,
    "completion_tokens": 7,
    "prompt_tokens_details": {"cached_tokens": 896},
}


def fed(*parts: bytes) -> tuple[int, int, int]:
    tail = UsageTail()
    for part in parts:
        tail.feed(part)
    return tail.counts()


def test_a_whole_answer_ends_with_its_usage() -> None:
    answer = json.dumps({"choices": [{"text": "x" * 100_000}], "usage": USAGE}).encode()
    assert fed(*(answer[i : i + 999] for i in range(0, len(answer), 999))) == (900, 7, 896)


def test_a_stream_has_it_in_its_last_event_and_text_cannot_fake_it() -> None:
    fake = json.dumps({"choices": [{"text": '"usage": {"prompt_tokens": 5}'}], "usage": None})
    last = json.dumps({"choices": [], "usage": USAGE})
    stream = f"data: {fake}\n\ndata: {last}\n\ndata: [DONE]\n\n".encode()
    assert fed(stream) == (900, 7, 896)
    assert fed(f"data: {fake}\n\ndata: [DONE]\n\n".encode()) == (0, 0, 0)


def test_no_usage_or_a_cut_one_counts_zero_and_the_tail_stays_bounded() -> None:
    assert fed(b'{"choices": []}') == (0, 0, 0)
    assert fed(b'{"usage": {"prompt_tokens": 3, "compl') == (0, 0, 0)
    tail = UsageTail()
    for _ in range(1000):
        tail.feed(b"y" * 1000)
    assert len(tail._tail) <= 2 * TAIL_BYTES
