"""The OpenAI front's body reader: what routing reads from a caller's body, and the 400s."""

from __future__ import annotations

import json

import pytest

from sidecar.server.openai_body import FrontError, FrontRequest, parse_request


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize(
    ("prompt", "route_text"),
    [
        ("rules then a question", "rules then a question"),
        (["first of a batch", "second"], "first of a batch"),
        ([1, 22, 333], "1,22,333"),
        ([[5, 6], [7]], "5,6"),
        ("", ""),
    ],
)
def test_a_completion_routes_on_its_prompt(prompt: object, route_text: str) -> None:
    parsed = parse_request(body(model="m", prompt=prompt, stream=True), chat=False)
    assert parsed == FrontRequest("m", route_text, True)


def test_a_chat_routes_on_its_first_message_the_system_one_included() -> None:
    messages = [
        {"role": "system", "content": "the fat rules"},
        {"role": "user", "content": "the thin query"},
    ]
    assert parse_request(body(messages=messages), chat=True) == FrontRequest(
        None, "the fat rules", False, (("system", "the fat rules"), ("user", "the thin query"))
    )
    parts = [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]
    parsed = parse_request(body(messages=[{"role": "user", "content": parts}]), chat=True)
    assert parsed.route_text == "ab"
    assert parsed.messages == (("user", "ab"),)  # organic routing's view (contract 8d)
    many = [{"role": "user", "content": str(i)} for i in range(50)] + ["not an object"]
    parsed = parse_request(body(messages=many), chat=True)
    assert parsed.messages == tuple(("user", str(i)) for i in range(33))  # LEARN_MESSAGES + 1
    parsed = parse_request(body(messages=[{"role": "assistant", "content": None}]), chat=True)
    assert parsed.route_text == ""


def test_unknown_fields_and_odd_numbers_are_left_alone() -> None:
    raw = b'{"zeta": 1e400, "prompt": "p", "big": 123456789012345678901234567890, "x": {}}'
    assert parse_request(raw, chat=False).route_text == "p"


@pytest.mark.parametrize(
    ("raw", "chat", "param", "words"),
    [
        (b"not json", False, None, "not valid JSON"),
        (b'{"prompt": "\xff"}', False, None, "not UTF-8"),
        (b"[1, 2]", False, None, "JSON object"),
        (body(model=3, prompt="p"), False, "model", "model must be a string"),
        (body(prompt="p", stream="yes"), False, "stream", "stream must be a boolean"),
        (body(model="m"), False, "prompt", "prompt is required"),
        (body(prompt=[1, "a"]), False, "prompt", "integers"),
        (body(prompt=[True]), False, "prompt", "integers"),
        (body(prompt={"a": 1}), False, "prompt", "prompt is required"),
        (body(model="m"), True, "messages", "messages is required"),
        (body(messages=[]), True, "messages", "messages is required"),
        (body(messages=["hi"]), True, "messages", "must be an object"),
        (body(messages=[{"content": 5}]), True, "messages", "string or a list of parts"),
    ],
)
def test_bad_bodies_are_400s_naming_the_param(
    raw: bytes, chat: bool, param: str | None, words: str
) -> None:
    with pytest.raises(FrontError) as caught:
        parse_request(raw, chat=chat)
    error = caught.value
    assert error.status == 400 and error.param == param and words in error.message
    assert json.loads(error.body()) == {
        "error": {
            "message": error.message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }
