"""Thin queries: a registered prefix's escaped bytes spliced into the caller's body, the
rest of the body byte for byte as written."""

from __future__ import annotations

import json

import pytest

from prefix_sidecar.server.openai.body import FrontError
from prefix_sidecar.server.openai.splice import splice_prefix
from prefix_sidecar.upstream.body import escape

PREFIX = 'rules: "quoted", a\\backslash,\na newline, 双十一 and \u2028 '


def test_the_prefix_goes_at_the_head_of_the_prompt_and_nothing_else_moves() -> None:
    raw = b'{ "zeta" : 1e400 ,"prompt":"the query \\u00e9", "n": 1.50, "model":"m"}'
    spliced = splice_prefix(raw, escape(PREFIX), chat=False)
    assert spliced == raw.replace(b'"prompt":"', b'"prompt":"' + escape(PREFIX))
    assert json.loads(spliced)["prompt"] == PREFIX + "the query \u00e9"


def test_the_prefix_is_the_system_message_before_the_callers_messages() -> None:
    raw = '{"model":"m","messages": [ {"role":"user","content":"你好"}],"x":[]}'.encode()
    spliced = splice_prefix(raw, escape(PREFIX), chat=True)
    messages = json.loads(spliced)["messages"]
    assert messages == [
        {"role": "system", "content": PREFIX},
        {"role": "user", "content": "你好"},
    ]
    assert spliced.endswith(b' {"role":"user","content":"' + "你好".encode() + b'"}],"x":[]}')


def test_only_the_top_level_member_counts_and_the_last_of_a_repeated_key() -> None:
    raw = b'{"extra": {"prompt": "nested"}, "prompt": "first", "prompt": "last"}'
    spliced = splice_prefix(raw, b"P", chat=False)
    assert spliced == b'{"extra": {"prompt": "nested"}, "prompt": "first", "prompt": "Plast"}'
    assert json.loads(spliced)["prompt"] == "Plast"


@pytest.mark.parametrize(
    ("raw", "chat", "words"),
    [
        (b'{"model": "m"}', False, "prompt is required"),
        (b"{}", True, "messages is required"),
        (b'{"prompt": ["a"]}', False, "must be a string"),
        (b'{"messages": []}', True, "non-empty"),
        (b"[]", False, "JSON object"),
        (b'{"prompt": "a" "b"}', False, "not valid JSON"),
    ],
)
def test_a_body_without_a_place_for_the_prefix_is_a_400(raw: bytes, chat: bool, words: str) -> None:
    with pytest.raises(FrontError) as caught:
        splice_prefix(raw, b"P", chat=chat)
    assert caught.value.status == 400 and words in caught.value.message
