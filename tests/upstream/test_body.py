"""Upstream bodies: `escape` is JSON's string escaping and splits at any character boundary
(prefix matching on escaped bytes relies on it); the spliced bodies are the JSON they claim."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefix_sidecar.upstream.body import SplicedBody, chat_body, completion_body, escape

# Every code point, lone surrogates aside (a request's text is valid UTF-8).
TEXT = st.text(st.characters(exclude_categories=["Cs"]))


@given(TEXT, TEXT)
def test_escape_of_a_concatenation_is_the_concatenation_of_escapes(a: str, b: str) -> None:
    assert escape(a + b) == escape(a) + escape(b)


@given(TEXT)
def test_escape_is_json_string_escaping_without_quotes(text: str) -> None:
    assert escape(text) == json.dumps(text, ensure_ascii=False)[1:-1].encode("utf-8")
    assert json.loads(b'"' + escape(text) + b'"') == text


@given(TEXT, TEXT)
def test_a_text_starts_with_another_exactly_when_its_escape_does(a: str, b: str) -> None:
    # What the prefix store's lookup on escaped bytes needs.
    assert escape(a + b).startswith(escape(a))
    assert escape(b).startswith(escape(a)) == b.startswith(a)


def test_escape_covers_quotes_backslashes_and_control_characters() -> None:
    assert escape('say "hi"\\\n\t\x00') == b'say \\"hi\\"\\\\\\n\\t\\u0000'
    assert escape("价格 😀") == "价格 😀".encode()


def test_a_spliced_body_is_its_parts_in_order_with_an_exact_size() -> None:
    body = SplicedBody(b'{"a":', b'"shared"', b"}")
    assert body.size == len(bytes(body)) == 14
    assert bytes(body) == b'{"a":"shared"}'
    assert body.parts == (b'{"a":', b'"shared"', b"}")


@given(TEXT, TEXT)
def test_a_completion_body_prompt_is_prefix_then_input(prefix: str, user_input: str) -> None:
    body = completion_body(escape(prefix), user_input, {"max_tokens": 3}, "m")
    data = json.loads(bytes(body))
    assert data == {
        "prompt": prefix + user_input,
        "max_tokens": 3,
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_a_completion_body_without_a_model_leaves_it_to_the_pod() -> None:
    data = json.loads(bytes(completion_body(b"", "q", {}, "")))
    assert "model" not in data and data["prompt"] == "q"


@given(TEXT, st.lists(st.tuples(st.sampled_from(["user", "assistant"]), TEXT), max_size=3))
def test_a_chat_body_puts_the_prefix_first_as_the_system_message(
    prefix: str, turns: list[tuple[str, str]]
) -> None:
    messages = [{"role": role, "content": content} for role, content in turns]
    data = json.loads(bytes(chat_body(escape(prefix), messages, {"seed": 1}, "m")))
    system = [{"role": "system", "content": prefix}] if prefix else []
    assert data["messages"] == system + messages
    assert data["seed"] == 1 and data["stream"] is True


EXTRA = b'"n":2, "response_format" : {"type":"json_object","z":1.0e-3,"a":[1E5]}'


def test_extra_members_are_one_more_part_written_as_the_caller_wrote_them() -> None:
    body = completion_body(escape("rules. "), "q", {"max_tokens": 3}, "m", EXTRA)
    raw = bytes(body)
    assert raw.endswith(b'{"include_usage": true},' + EXTRA + b"}")
    assert b"rules. " in body.parts  # the prefix is still the shared part, not copied
    data = json.loads(raw)
    assert data["prompt"] == "rules. q" and data["n"] == 2
    assert list(data["response_format"]) == ["type", "z", "a"]


@pytest.mark.parametrize("prefix", [b"", escape("rules. ")])
def test_a_chat_body_takes_extra_members_with_and_without_a_prefix(prefix: bytes) -> None:
    messages = [{"role": "user", "content": "q"}]
    raw = bytes(chat_body(prefix, messages, {}, "", EXTRA))
    assert raw.endswith(b'{"include_usage": true},' + EXTRA + b"}")
    assert json.loads(raw)["messages"][-1] == messages[0]
