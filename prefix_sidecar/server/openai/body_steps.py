"""A large body read in steps of the event loop, by ijson's C parser (yajl).

json.loads is one C call holding the GIL (8 MiB of token ids held the loop ~1.3 s, `prefix-sidecar
bench body`), so a body over SYNC_BYTES goes to ijson's push parser SLICE bytes per step. Its
events go to readers that keep only what body._read checks (model, stream, cache_salt, a
token-id prompt's head with every id checked, a chat's first LEARN_MESSAGES + 1 messages and
its assistant count): decisions and errors match a whole read, and the read adds ~1 MiB at
most. A body that is mostly its route string is read as body.py reads a small one.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import replace
from functools import partial
from typing import Any

import ijson

from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.routing.organic import LEARN_MESSAGES
from prefix_sidecar.server.openai.body import (
    MAX_DEPTH,
    QUOTE_CHARS,
    FrontRequest,
    _read,
    bad_request,
    parse_around,
    route_string_cut,
    too_deep,
)

# Up to this, json.loads is one step: 64 KiB of the densest JSON (small ints) is ~2.5 ms.
SYNC_BYTES = 64 * 1024
# Bytes parsed in one step of the loop: 16 KiB of one-digit token ids (8k events) is ~2 ms.
SLICE = 16 * 1024
# The C backend by name: a missing build fails at start, not as a many-times-slower Python
# fallback. use_float: as exact numbers, an integer past the interpreter's 4,300-digit limit
# crashes the process (ijson 3.6 puts a NULL in the event). So a large body's integer past 64
# bits or float past a double is a 400 (json.loads takes it): routing and sampling need none.
_PARSER = ijson.get_backend("yajl2_c")
_OPENS = frozenset(("start_map", "start_array"))
_CLOSES = frozenset(("end_map", "end_array"))

Event = tuple[str, Any]
Events = Generator[None, Event, Any]  # a reader: sent the parser's events, returns what it read
Reader = Callable[[str, Any, int], Events]


async def read_request(
    raw: bytes, *, chat: bool, store: PrefixStore | None, window: int, turns: bool
) -> FrontRequest:
    """body.parse_request, for a body of any size under the limit, in steps (the front
    gives every setting; parse_request's defaults are for its tests)."""
    cut = route_string_cut(raw, chat, store)
    if len(raw) - (cut.end - cut.start if cut is not None else 0) <= SYNC_BYTES:
        return parse_around(raw, cut, chat=chat, window=window, turns=turns)
    head_chars = max([window, *(entry.chars for entry in store or ())]) + 1
    return await read_in_steps(raw, chat, head_chars)


async def read_in_steps(raw: bytes, chat: bool, head_chars: int) -> FrontRequest:
    """What body._read reads of the whole body, parsed a slice per step of the loop: a
    prompt of token ids reads as its head, at least head_chars characters of their text."""
    found: list[Any] = []
    sink = _document(found, chat, head_chars)
    next(sink)
    events = ijson.sendable_list()
    parser = _PARSER.basic_parse_coro(events, use_float=True)
    try:
        if (encoding := json.detect_encoding(raw)) != "utf-8":
            raw = raw.decode(encoding).encode()  # UTF-16 or 32, or a BOM: yajl reads UTF-8
        view, at, size = memoryview(raw), 0, SLICE
        while at < len(raw):
            parser.send(view[at : at + size])
            at += size
            if events:
                deque(map(sink.send, events), maxlen=0)  # to the readers, no Python loop
                events.clear()
                size = SLICE
            else:  # inside one token, which yajl lexes again from its start each slice:
                size *= 2  # doubling the slice keeps that linear
            await asyncio.sleep(0)
        parser.close()
        deque(map(sink.send, events), maxlen=0)
    except UnicodeDecodeError:
        raise bad_request("the body is not UTF-8 JSON") from None
    except ijson.JSONError as exc:
        message = str(exc)
        if "UTF8" in message:
            raise bad_request("the body is not UTF-8 JSON") from None
        first_line = message.splitlines()[0][:QUOTE_CHARS]
        raise bad_request(f"the body is not valid JSON: {first_line}") from None
    data = found[0]
    if not (chat and isinstance(data, dict) and "messages" in data):
        return _read(data, chat)
    data["messages"], answers = data["messages"]
    return replace(_read(data, chat=True), answers=answers)


def _document(found: list[Any], chat: bool, head_chars: int) -> Events:
    """The readers' root, sent every event: what routing reads of the top-level value,
    into `found`."""
    event, value = yield
    if event == "start_map":
        prompt: Reader = partial(_prompt, head_chars)
        fields = _CHAT if chat else {**_COMPLETION, "prompt": prompt}
        found.append((yield from _object(fields, 1)))
    else:
        found.append((yield from _value(event, value, 0)))  # not an object: _read says so
    while True:
        yield  # nothing follows the top-level value: the parser refuses it


def _object(fields: dict[str, Reader], depth: int) -> Events:
    """An object just opened, `depth` levels deep: its `fields`, each by its reader (the
    last of a repeated key, as json.loads keeps), the other keys skipped."""
    read: dict[str, Any] = {}
    while True:
        event, key = yield
        if event == "end_map":
            return read
        event, value = yield
        reader = fields.get(key)
        if reader is None:
            yield from _value(event, value, depth)
        else:
            read[key] = yield from reader(event, value, depth)


def _value(event: str, value: Any, depth: int) -> Events:
    """A value inside `depth` levels: a scalar as it is; a container skipped (its depth
    checked), read as an empty one of its kind (it is not a string, a number or null)."""
    if event not in _OPENS:
        return value
    level = depth + 1
    while True:
        inner, _ = yield
        if inner in _OPENS:
            level += 1
            if level > MAX_DEPTH:
                raise too_deep()
        elif inner in _CLOSES:
            if level == depth + 1:
                return {} if event == "start_map" else []
            level -= 1


def _prompt(head_chars: int, event: str, value: Any, depth: int) -> Events:
    """The prompt as body._prompt_text reads it: a string; a batch's first string or first
    list of token ids; token ids (a bool is refused among them, as an int it is)."""
    if event != "start_array":
        return (yield from _value(event, value, depth))
    event, value = yield
    if event == "end_array":
        return []
    if isinstance(value, int):
        return (yield from _token_ids(head_chars, event, value, depth + 1))
    if event == "start_array":
        event, value = yield
        first = yield from _token_ids(head_chars, event, value, depth + 2)
    else:
        first = yield from _value(event, value, depth + 1)
    yield from _value("start_array", None, depth)  # the rest of the batch: the pod's to check
    return [first]


def _token_ids(head_chars: int, event: str, value: Any, depth: int) -> Events:
    """An array of token ids from its first item (`event`, `value`): the ids whose decimal
    text reaches head_chars characters, then the first bool and the first other non-integer
    found among all of them (what body._token_text and _prompt_text refuse). The ids past
    the head are checked, not kept."""
    head: list[int] = []
    odd: dict[bool, Any] = {}
    size = 0
    while True:
        if type(value) is int:
            if size < head_chars:
                head.append(value)
                size += len(str(value)) + 1
        elif event == "end_array":
            return [*head, *odd.values()]
        else:
            value = yield from _value(event, value, depth)
            odd.setdefault(isinstance(value, bool), value)
        event, value = yield


def _messages(event: str, value: Any, depth: int) -> Events:
    """A chat's messages as body._read reads them, and how many are the assistant's: the
    first LEARN_MESSAGES + 1, each its role and content; of the others, the role only."""
    if event != "start_array":
        return (yield from _value(event, value, depth)), 0
    kept: list[Any] = []
    answers = 0
    while True:
        event, value = yield
        if event == "end_array":
            return kept, answers
        if event == "start_map":
            whole = len(kept) <= LEARN_MESSAGES
            message = yield from _object(_MESSAGE if whole else _ROLE, depth + 2)
            answers += message.get("role") == "assistant"
        else:
            message = yield from _value(event, value, depth + 1)
        if len(kept) <= LEARN_MESSAGES:
            kept.append(message)


def _content(event: str, value: Any, depth: int) -> Events:
    """A message's content: a string, or its text parts joined into one part (what
    body._content_text reads of them)."""
    if event != "start_array":
        return (yield from _value(event, value, depth))
    texts: list[str] = []
    while True:
        event, value = yield
        if event == "end_array":
            return [{"text": "".join(texts)}]
        if event == "start_map":
            text = (yield from _object(_PART, depth + 2)).get("text")
            if isinstance(text, str):
                texts.append(text)
        else:
            yield from _value(event, value, depth + 1)


_COMPLETION: dict[str, Reader] = {"model": _value, "stream": _value, "cache_salt": _value}
_CHAT: dict[str, Reader] = {**_COMPLETION, "messages": _messages}
_ROLE: dict[str, Reader] = {"role": _value}
_MESSAGE: dict[str, Reader] = {**_ROLE, "content": _content}
_PART: dict[str, Reader] = {"text": _value}
