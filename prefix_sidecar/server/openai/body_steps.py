"""A large body read in steps of the event loop, each under STEP_S.

json.loads is one C call: an 8 MiB body of 4M token ids held the loop 0.84-1.0 s, one of
270k chat messages ~0.3 s, and every other caller (gRPC health checks included) waited. A
thread would not help (json.loads holds the GIL). So a body over SYNC_BYTES is read here:
- a prompt of token ids (a flat array of numbers) is never decoded whole: its characters
  are checked in slices, only the head routing reads is decoded (the router reads the
  route window, the prefix store its longest prefix), and json.loads reads the rest of the
  body with the array cut out, as body.py does for a string prompt. What is not decoded
  is the pod's to validate, as vLLM does (400);
- anything else is decoded by `loads_in_steps`, which builds what json.loads builds: runs
  of an array's elements and containers that fit in WINDOW characters are each one
  json.loads call, larger containers are walked (an explicit stack: no recursion, at most
  MAX_DEPTH levels), and the loop is given back once a step has run STEP_S;
- then what routing reads of it (`read_in_steps`): the assistant messages counted, token
  ids checked, content parts joined, in slices.
A string prompt, or a first message's content, found where it lies (body.route_string_cut)
is cut out first, as in body.parse_request; the decision is the same either way.
"""

from __future__ import annotations

import asyncio
import codecs
import gc
import json
import json.scanner
import re
import time
from collections.abc import Callable
from typing import Any

from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.routing.organic import LEARN_MESSAGES
from prefix_sidecar.server.openai.body import (
    _MARK,
    _MARK_JSON,
    MAX_DEPTH,
    QUOTE_CHARS,
    FrontError,
    FrontRequest,
    _expect,
    _read,
    bad_request,
    cut_out,
    parse_request,
    read_cut,
    route_string_cut,
    too_deep,
)

# Up to this, json.loads is one step: 64 KiB of the densest JSON (small ints) is ~2.5 ms.
SYNC_BYTES = 64 * 1024
STEP_S = 0.003  # a step gives the loop back once it has run this long
WINDOW = 32 * 1024  # characters json.loads reads in one call (~1 ms at the densest)
SLICE = 1024 * 1024  # bytes decoded or checked in one call
ITEMS = 16_384  # list items looked at in one call

_TOKEN_CHARS = b"0123456789,- \t\r\n"


def _nested(levels: int) -> str:
    """A regex of a JSON container nesting at most `levels` levels, read as one match with
    no backtracking (atomic groups, possessive repeats): linear in what it reads. It
    checks only where the container ends; json.loads then reads it."""
    string = r'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
    inner = string
    for _ in range(levels):
        item = rf'(?>[^{{}}\[\]"]++|{inner})'
        inner = rf"(?>{string}|\{{{item}*+\}}|\[{item}*+\])"
    return inner


_NESTED = 4  # a chat message with content parts nests 3 levels
_CONTAINER = re.compile(_nested(_NESTED))
# Array elements, each followed by its comma: containers as above, strings, other scalars.
_RUN = re.compile(rf'(?>[ \t\n\r]*+(?>{_nested(_NESTED)}|[^,\[\]{{}}" \t\n\r]++)[ \t\n\r]*+,)++')
_WS = re.compile(r"[ \t\n\r]*")
_walking = 0  # walks under way while the collector is held off (by them)
_scan: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]  # typeshed: the class, not a decoder


class _Steps:
    """Gives the loop back once STEP_S has passed since it last did."""

    def __init__(self) -> None:
        self._due = time.perf_counter() + STEP_S

    async def tick(self) -> None:
        if time.perf_counter() >= self._due:
            await asyncio.sleep(0)
            self._due = time.perf_counter() + STEP_S


async def read_request(
    raw: bytes,
    *,
    chat: bool,
    store: PrefixStore | None = None,
    window: int = 4096,
    turns: bool = True,
) -> FrontRequest:
    """body.parse_request, for a body of any size under the limit, in steps."""
    if len(raw) <= SYNC_BYTES:
        return parse_request(raw, chat=chat, store=store, window=window, turns=turns)
    steps = _Steps()
    head_chars = max([window, *(entry.chars for entry in store or ())]) + 1
    if not chat:
        ids = await _token_prompt(raw, steps, head_chars)
        if ids is not None:
            return ids
    cut = route_string_cut(raw, chat, store)
    if cut is not None and not (chat and cut.prefix is None):  # such a chat is read whole
        try:
            data = await loads_in_steps(cut_out(raw, cut), steps)
        except FrontError:
            data = None  # invalid: read whole, it says where
        if data is not None:
            found = read_cut(raw, cut, await read_in_steps(data, chat, head_chars, steps), chat,
                             window, turns)  # fmt: skip
            if found is not None:
                return found
    return await read_in_steps(await loads_in_steps(raw, steps), chat, head_chars, steps)


async def _token_prompt(raw: bytes, steps: _Steps, head_chars: int) -> FrontRequest | None:
    """A prompt of token ids, its array cut out of the body and only its head decoded;
    None when the prompt is not a flat array of numbers (or not where it looks to be)."""
    start = _expect(raw, 0, (b'"prompt"', b":", b"["))
    if start is None:
        return None
    end = raw.find(b"]", start)
    if end < 0 or any(raw.find(c, start, end) >= 0 for c in (b"[", b"{", b"}", b'"')):
        return None
    for at in range(start, end, SLICE):
        if raw[at : min(at + SLICE, end)].translate(None, _TOKEN_CHARS):
            return None  # a float, true, ...: json.loads on the whole says what
        await steps.tick()
    try:
        data = await loads_in_steps(raw[: start - 1] + _MARK_JSON + raw[end + 1 :], steps)
    except FrontError:
        return None
    if not isinstance(data, dict) or data.get("prompt") != _MARK:
        return None  # the prompt is elsewhere (a key repeated, a nested object): read whole
    # The head: enough ids for head_chars characters of their decimal text. A caller's
    # text of an id is at least as long as its decimal text, so head_chars bytes (then
    # twice that, ...) of the array hold enough, or all of it.
    take = head_chars
    while True:
        stop = end if start + take >= end else raw.rfind(b",", start, start + take)
        if stop <= start:
            stop = raw.find(b",", start + take, end)
            stop = end if stop < 0 else stop
        try:
            ids = json.loads(b"[" + raw[start:stop] + b"]")
        except ValueError as exc:
            raise bad_request(f"the body is not valid JSON: {str(exc)[:QUOTE_CHARS]}") from None
        if stop == end or len(",".join(map(str, ids))) >= head_chars:
            break
        take *= 2
    return _read(dict(data, prompt=ids), chat=False)


async def loads_in_steps(raw: bytes, steps: _Steps | None = None) -> Any:
    """json.loads(raw), in steps of the loop; FrontError 400 when it is not JSON. The
    collector is held off meanwhile: a full collection would walk the growing tree (270k
    messages: 10-60 ms a pass, on the loop), which reference counting frees once read."""
    global _walking
    steps = steps or _Steps()
    text = await _decode(raw, steps)
    if not _walking and gc.isenabled():
        gc.disable()
        _walking = 1
    elif _walking:
        _walking += 1
    try:
        return await _walk(text, steps)
    except RecursionError:
        raise too_deep() from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {str(exc)[:QUOTE_CHARS]}") from None
    finally:
        if _walking:
            _walking -= 1
            if not _walking:
                gc.enable()


async def _decode(raw: bytes, steps: _Steps) -> str:
    try:
        encoding = json.detect_encoding(raw)
        if len(raw) <= SLICE:
            return raw.decode(encoding, "surrogatepass")
        decoder = codecs.getincrementaldecoder(encoding)("surrogatepass")
        parts = []
        for at in range(0, len(raw), SLICE):
            parts.append(decoder.decode(raw[at : at + SLICE], at + SLICE >= len(raw)))
            await steps.tick()
        return "".join(parts)
    except UnicodeDecodeError:
        raise bad_request("the body is not UTF-8 JSON") from None


def _error(message: str, text: str, at: int) -> json.JSONDecodeError:
    return json.JSONDecodeError(message, text, at)


async def _walk(text: str, steps: _Steps) -> Any:
    """What json.loads(text) returns. The stack holds the open containers (a list, or a
    dict with the key its next value goes to)."""
    stack: list[list[Any] | dict[str, Any]] = []
    keys: list[str] = []
    at = _WS.match(text, 0).end()  # type: ignore[union-attr]  # always matches
    expect_key = False
    while True:
        await steps.tick()
        top = stack[-1] if stack else None
        if expect_key:
            if not text.startswith('"', at):
                raise _error("Expecting property name enclosed in double quotes", text, at)
            key, at = _scan(text, at)
            at = _WS.match(text, at).end()  # type: ignore[union-attr]
            if not text.startswith(":", at):
                raise _error("Expecting ':' delimiter", text, at)
            at = _WS.match(text, at + 1).end()  # type: ignore[union-attr]
            keys[-1] = key
            expect_key = False
            continue
        if isinstance(top, list):
            run = _run(text, at)
            if run > at:  # whole elements, up to an array-level comma or the close
                top.extend(json.loads("[" + text[at:run] + "]"))
                at = run
                value_read = True
            else:
                value_read = False
        else:
            value_read = False
        if not value_read:
            opener = text[at : at + 1]
            if opener in ("[", "{"):
                end = _extent(text, at)
                if end < 0:  # larger than the window: walked
                    if len(stack) >= MAX_DEPTH:
                        raise RecursionError
                    at = _WS.match(text, at + 1).end()  # type: ignore[union-attr]
                    if text.startswith("]" if opener == "[" else "}", at):
                        value: Any = [] if opener == "[" else {}
                        at += 1
                    else:
                        stack.append([] if opener == "[" else {})
                        keys.append("")
                        expect_key = opener == "{"
                        continue
                else:
                    value = json.loads(text[at:end])
                    at = end
            else:
                try:
                    value, at = _scan(text, at)
                except StopIteration:
                    raise _error("Expecting value", text, at) from None
            if top is None:
                break
            if isinstance(top, list):
                top.append(value)
            else:
                top[keys[-1]] = value
        # After a value in a container: a comma, or the container's close (maybe several).
        while True:
            at = _WS.match(text, at).end()  # type: ignore[union-attr]
            top = stack[-1]
            close = "]" if isinstance(top, list) else "}"
            if text.startswith(",", at):
                at = _WS.match(text, at + 1).end()  # type: ignore[union-attr]
                expect_key = close == "}"
                break
            if not text.startswith(close, at):
                raise _error(f"Expecting ',' delimiter or '{close}'", text, at)
            at += 1
            value = stack.pop()
            keys.pop()
            if not stack:
                break
            parent = stack[-1]
            if isinstance(parent, list):
                parent.append(value)
            else:
                parent[keys[-1]] = value
        if not stack:
            break
    at = _WS.match(text, at).end()  # type: ignore[union-attr]
    if at != len(text):
        raise _error("Extra data", text, at)
    return value


def _run(text: str, at: int) -> int:
    """The end of the whole array elements from `at` that fit in WINDOW, each followed by
    its comma (the index of the last of those commas), when the elements nest at most
    _NESTED levels; `at` when the first is not one of them."""
    found = _RUN.match(text, at, min(len(text), at + WINDOW))
    return found.end() - 1 if found is not None and found.end() > at else at


def _extent(text: str, at: int) -> int:
    """The end (after its close) of the container opening at `at`, when it closes within
    WINDOW and nests at most _NESTED levels; -1 otherwise."""
    found = _CONTAINER.match(text, at, min(len(text), at + WINDOW))
    return found.end() if found is not None else -1


async def read_in_steps(data: Any, chat: bool, head_chars: int, steps: _Steps) -> FrontRequest:
    """body._read(data, chat), its work on long lists done in slices: the route text of
    token ids is their head (at least head_chars characters: all that routing reads)."""
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    if chat:
        messages = data.get("messages")
        if isinstance(messages, list):
            answers = 0
            for at in range(0, len(messages), ITEMS):
                answers += sum(
                    1
                    for m in messages[at : at + ITEMS]
                    if isinstance(m, dict) and m.get("role") == "assistant"
                )
                await steps.tick()
            head = [await _joined(m, steps) for m in messages[: LEARN_MESSAGES + 1]]
            request = _read(dict(data, messages=head), chat=True)
            return FrontRequest(
                request.model, request.route_text, request.stream, request.messages, answers
            )
        return _read(data, chat=True)
    prompt = data.get("prompt")
    tokens = prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        tokens = prompt[0]  # a batch routes on its first prompt
    if isinstance(tokens, list) and len(tokens) > ITEMS and isinstance(tokens[0], int):
        for at in range(0, len(tokens), ITEMS):
            if not all(type(t) is int for t in tokens[at : at + ITEMS]):
                raise bad_request("prompt token ids must be integers", "prompt")
            await steps.tick()
        count, size = 0, 0
        while size < head_chars and count < len(tokens):
            size += len(str(tokens[count])) + 1
            count += 1
        head = tokens[:count]
        return _read(dict(data, prompt=head if tokens is prompt else [head]), chat=False)
    return _read(data, chat=False)


async def _joined(message: Any, steps: _Steps) -> Any:
    """A message whose content is a long list of parts, with them joined in slices into
    one text part (what body._content_text reads of them)."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if not isinstance(content, list) or len(content) <= ITEMS:
        return message
    texts = []
    for at in range(0, len(content), ITEMS):
        texts.append(
            "".join(
                part["text"]
                for part in content[at : at + ITEMS]
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
        )
        await steps.tick()
    return dict(message, content=[{"type": "text", "text": "".join(texts)}])
