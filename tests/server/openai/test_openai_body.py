"""The OpenAI front's body reader: what routing reads from a caller's body, and the 400s."""

from __future__ import annotations

import json

import pytest

from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.routing.chat_templates import NOT_FOLLOWED
from prefix_sidecar.server.openai.body import FrontError, FrontRequest, parse_request


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
        None, "the fat rules", False, (("system", "the fat rules"), ("user", "the thin query")), 0
    )
    parts = [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]
    parsed = parse_request(body(messages=[{"role": "user", "content": parts}]), chat=True)
    assert parsed.route_text == "ab"
    assert parsed.messages == (("user", "ab"),)  # organic routing's view (contract 9d)
    many = [{"role": "user", "content": str(i)} for i in range(50)] + ["not an object"]
    parsed = parse_request(body(messages=many), chat=True)
    assert parsed.messages == tuple(("user", str(i)) for i in range(33))  # LEARN_MESSAGES + 1
    parsed = parse_request(body(messages=[{"role": "assistant", "content": None}]), chat=True)
    assert parsed.route_text == ""


def test_a_chats_answers_are_counted_over_all_its_messages() -> None:
    """Session follow (contract 9h) tells a conversation's next request by its assistant
    messages: all of them, past the first LEARN_MESSAGES + 1 that routing chains."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": str(i)} for i in range(61)]
    parsed = parse_request(body(messages=[*turns, "not an object"]), chat=True)
    assert len(parsed.messages) == 33 and parsed.answers == 30
    assert parse_request(body(prompt="p"), chat=False).marks is None  # the router reads them


def test_a_long_rendered_prompts_turns_are_read_in_the_body() -> None:
    """The fast path decodes only a long prompt's head (`window`): the marks of its chat
    template (9h) are read where the prompt lies in the body, at its end."""
    turns = "".join(
        f'<|im_start|>user\nq{i} "quoted"<|im_end|>\n<|im_start|>assistant\n{"a" * 900}<|im_end|>\n'
        for i in range(40)
    )
    prompt = "<|im_start|>system\nrules<|im_end|>\n" + turns + "<|im_start|>assistant\n"
    raw = body(prompt=prompt)
    parsed = parse_request(raw, chat=False, store=PrefixStore(), window=4096)
    assert parsed.matched and len(parsed.route_text) < len(prompt)
    start = raw.index(b'"prompt": "') + len(b'"prompt": "')
    header = b"<|im_start|>assistant"
    assert parsed.marks == (raw.rindex(header) - start, raw.rindex(header, 0, -40) - start)
    plain = parse_request(body(prompt="x" * 50_000), chat=False, store=PrefixStore())
    assert plain.matched and plain.marks == NOT_FOLLOWED  # no template: nothing to follow
    # a router that follows no conversation: not read
    unfollowed = parse_request(raw, chat=False, store=PrefixStore(), turns=False)
    assert unfollowed.matched and unfollowed.marks == NOT_FOLLOWED


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


# --- matching where the prompt lies in the body ----------------------------------------------

RULES = 'Mega-sale rules: "no lowest price ever"\n双十一 \\ tab\there\n' * 40
WINDOW = 64


def _store(*texts: str) -> PrefixStore:
    store = PrefixStore()
    for index, text in enumerate(texts):
        store.register(f"p{index}", text)
    return store


def _expected(store: PrefixStore, raw: bytes, chat: bool) -> tuple[str | None, bytes]:
    """What Router.for_prompt reads of the decoded route text: the longest registered
    prefix, else the route window's bytes."""
    text = parse_request(raw, chat=chat).route_text  # the whole json.loads path
    found = store.match(text)
    return (found.name if found else None), text.encode()[:WINDOW]


def _routed(store: PrefixStore, raw: bytes, chat: bool) -> tuple[str | None, bytes]:
    parsed = parse_request(raw, chat=chat, store=store, window=WINDOW)
    if parsed.matched and parsed.prefix is not None:
        return parsed.prefix.name, b""
    found = store.match(parsed.route_text)
    return (found.name if found else None), parsed.route_text.encode()[:WINDOW]


def _same(expected: tuple[str | None, bytes], routed: tuple[str | None, bytes]) -> bool:
    return expected[0] == routed[0] and (expected[0] is not None or expected[1] == routed[1])


@pytest.mark.parametrize("ensure_ascii", [False, True])
@pytest.mark.parametrize(
    "prompt",
    [
        RULES + "is this 499 yuan offer compliant?",
        RULES,
        RULES[:-7] + "a different ending " * 30,  # shares a head with the prefix only
        "unregistered " * 200 + '"quoted" / slashes',
        "short",
        RULES.replace("/", "\\/"),
        ("x" * 70 + "\\u00e9") * 20,  # escapes written by hand in the text itself
    ],
)
def test_matching_in_the_body_routes_as_the_decoded_prompt_does(
    prompt: str, ensure_ascii: bool
) -> None:
    store = _store(RULES, RULES[:100], "short prefix")
    raw = json.dumps(
        {"model": "m", "prompt": prompt, "stream": True, "n": 1}, ensure_ascii=ensure_ascii
    ).encode()
    assert _same(_expected(store, raw, False), _routed(store, raw, False))
    chat = json.dumps(
        {"messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "q"}]},
        ensure_ascii=ensure_ascii,
    ).encode()
    assert _same(_expected(store, chat, True), _routed(store, chat, True))


def test_a_canonical_prompt_is_matched_in_place_and_only_its_head_decoded() -> None:
    store = _store(RULES)
    raw = json.dumps(
        {"model": "m", "prompt": RULES + "question", "stream": True}, ensure_ascii=False
    ).encode()
    parsed = parse_request(raw, chat=False, store=store, window=WINDOW)
    assert parsed.matched and parsed.prefix is not None and parsed.prefix.name == "p0"
    assert (parsed.model, parsed.stream) == ("m", True)
    fat = json.dumps({"prompt": "no prefix here " * 2000}, ensure_ascii=False).encode()
    head = parse_request(fat, chat=False, store=store, window=WINDOW)
    assert head.matched and head.prefix is None
    assert WINDOW <= len(head.route_text.encode()) < 1000


@pytest.mark.parametrize(
    "raw",
    [
        # "prompt" where the quick look finds it is not the top-level one
        b'{"meta": {"prompt": "' + b"n" * 400 + b'"}, "prompt": "the real one"}',
        # the key repeats: json.loads reads the last
        b'{"prompt": "' + b"a" * 400 + b'", "prompt": "' + b"b" * 400 + b'"}',
        # a prompt with more escaped quotes than are looked at
        b'{"prompt": "' + b'\\"q\\" ' * 400 + b'"}',
        b'{"prompt": "' + b"\\\\" * 300 + b'", "stream": true}',
    ],
)
def test_unusual_bodies_read_as_json_loads_reads_them(raw: bytes) -> None:
    store = _store("n" * 300, "a" * 300, "b" * 300)
    assert _same(_expected(store, raw, False), _routed(store, raw, False))
    assert (
        parse_request(raw, chat=False, store=store).stream == parse_request(raw, chat=False).stream
    )


def test_invalid_json_around_a_long_prompt_is_still_a_400() -> None:
    store = _store(RULES)
    raw = b'{"prompt": "' + json.dumps(RULES)[1:-1].encode() + b'", "stream": tru}'
    with pytest.raises(FrontError) as caught:
        parse_request(raw, chat=False, store=store)
    assert caught.value.status == 400 and "not valid JSON" in caught.value.message
