"""What the OpenAI HTTP front reads from a caller's body, and its errors in OpenAI's shape.

The body goes to the pod as the caller wrote it: only what routing needs is read (model,
prompt or first message, stream) and nothing is re-serialized. To avoid decoding a long
prompt, the route string is matched against the registered prefixes where it lies, as the
caller escaped it, then cut out so json.loads reads only the rest. That finds what
Router.for_prompt finds while the bytes the match reads are the canonical escape
(prefix_sidecar.upstream.body.escape); anything else (a \\u or \\/ escape there, content
parts, a key in an unusual place) takes the whole json.loads, so the decision is the same
either way. The unread rest of a long prompt is the pod's to validate (vLLM answers 400).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from prefix_sidecar.prefixes import PrefixEntry, PrefixStore
from prefix_sidecar.routing.chat_templates import NOT_FOLLOWED, turn_marks_escaped
from prefix_sidecar.routing.organic import LEARN_MESSAGES
from prefix_sidecar.routing.scope import checked_salt

# What of a caller's text may reach an error message.
QUOTE_CHARS = 80
# The deepest nesting body_steps reads (json.loads stops at the recursion limit, ~1,000
# levels); vLLM answers 400 as well.
MAX_DEPTH = 900


class FrontError(Exception):
    """An HTTP error with OpenAI's body, {"error": {"message", "type", "param", "code"}},
    which the openai SDK maps by status to its exceptions (400 BadRequestError, ...)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()


def bad_request(message: str, param: str | None = None) -> FrontError:
    return FrontError(400, message, param=param)


@dataclass(frozen=True)
class FrontRequest:
    """What routing reads from a completions or chat body."""

    model: str | None
    route_text: str  # the prompt, or the first message's text; its head when `matched`
    stream: bool
    # A chat's first LEARN_MESSAGES + 1 messages as (role, text), for organic routing (9d).
    messages: tuple[tuple[str, str], ...] = ()
    # A chat's assistant messages, all of them (organic routing's session follow, 9h).
    answers: int | None = None
    # A prompt's chat-template (mark, after), read in the body when `route_text` is only its
    # head (9h); None: the prompt was read whole and the router finds them.
    marks: tuple[int, int] | None = None
    # The prefixes were matched on the body's bytes: `prefix` is the longest the route text
    # starts with (None: none), `route_text` at least its first `window` bytes.
    matched: bool = False
    prefix: PrefixEntry | None = None
    cache_salt: str = ""  # vLLM's, as the caller sent it (routing contract 10)


# Escaped quotes looked at while finding where a route text ends; past them, json.loads.
MAX_QUOTES = 256
# What the route text reads as in the body once it is cut out: no caller can write it (a
# random part per process).
_MARK = "\x00prefix-sidecar-" + secrets.token_hex(8)
_MARK_JSON = json.dumps(_MARK).encode()
# Escapes `escape` never writes: a caller's text holding one is matched the slow way.
_NOT_CANONICAL = (b"\\u", b"\\/")
_WHITESPACE = re.compile(rb"[ \t\n\r]*")
_COMPLETION_HEAD = (b'"prompt"', b":", b'"')
_CHAT_HEAD = (b'"messages"', b":", b"[", b"{")
_CONTENT_HEAD = (b'"content"', b":", b'"')


def parse_request(
    raw: bytes,
    *,
    chat: bool,
    store: PrefixStore | None = None,
    window: int = 4096,
    turns: bool = True,
) -> FrontRequest:
    """Read the routing fields; FrontError 400 on a body that is not a JSON object or lacks
    its prompt or messages. With `store`, the route text is matched where it lies when it
    can be (FrontRequest.matched); `window`: the router's route_window_bytes; `turns`: read
    a long prompt's chat-template turns (9h). One loop step: body_steps.read_request steps
    bodies over SYNC_BYTES."""
    cut = route_string_cut(raw, chat, store)
    return parse_around(raw, cut, chat=chat, window=window, turns=turns)


def parse_around(
    raw: bytes, cut: Cut | None, *, chat: bool, window: int, turns: bool
) -> FrontRequest:
    """parse_request, the route string found already (`cut`; None: not to be cut out)."""
    if cut is not None:
        try:
            data = json.loads(cut_out(raw, cut))
        except RecursionError:
            raise too_deep() from None
        except ValueError:
            data = None  # invalid: json.loads on the whole says where
        if data is not None:
            found = read_cut(raw, cut, _read(data, chat), chat, window, turns)
            if found is not None:
                return found
    return _read(_loads(raw), chat)


@dataclass(frozen=True)
class Cut:
    """A route text found where it lies in the body: raw[start:end] is its escaped string,
    `prefix` the longest registered prefix it starts with (None: none)."""

    start: int
    end: int
    prefix: PrefixEntry | None


def route_string_cut(raw: bytes, chat: bool, store: PrefixStore | None) -> Cut | None:
    """The route string to cut out of the body before json.loads reads the rest, when the
    registered prefixes can be matched on its bytes (bounded: at most MAX_QUOTES quotes
    and the longest prefix are looked at)."""
    if store is None:
        return None
    start = _route_string(raw, chat)
    if start is None:
        return None
    prefix = store.match_escaped(raw, start)
    proven = len(prefix.json_bytes) if prefix is not None else 0  # the same bytes as escape()
    end = _string_end(raw, start + proven)
    if end is None:
        return None
    # Up to where the match could look, the caller's escape must be escape()'s.
    reach = min(end, start + store.escaped_reach(raw, start))
    for escape in _NOT_CANONICAL:
        if raw.find(escape, start + proven, reach) >= 0:
            return None
    return Cut(start, end, prefix)


def cut_out(raw: bytes, cut: Cut) -> bytes:
    """The body with the route string replaced by the mark."""
    return raw[: cut.start - 1] + _MARK_JSON + raw[cut.end + 1 :]


def read_cut(
    raw: bytes, cut: Cut, request: FrontRequest, chat: bool, window: int, turns: bool
) -> FrontRequest | None:
    """What routing reads, given `request` as read from the body with the route string cut
    out; None when the body must be read whole after all."""
    if request.route_text != _MARK:
        if _MARK in request.route_text:  # the text was one of a message's content parts
            return None
        return request  # the route text is elsewhere in the body, and was read whole
    if cut.prefix is None and chat:
        return None  # an unregistered chat routes on its messages
    if cut.prefix is not None:  # a registered prefix: no organic routing, nothing to read
        return FrontRequest(
            request.model,
            "",
            request.stream,
            matched=True,
            prefix=cut.prefix,
            cache_salt=request.cache_salt,
        )
    head = _decoded_head(raw, cut.start, cut.end, window)
    # read in the body, undecoded; not at all when the router would not look
    marks = turn_marks_escaped(raw, cut.start, cut.end) if turns else NOT_FOLLOWED
    return FrontRequest(
        request.model,
        head,
        request.stream,
        marks=marks,
        matched=True,
        cache_salt=request.cache_salt,
    )


def route_string_span(raw: bytes, chat: bool) -> tuple[int, int] | None:
    """(start, end) of the route string's escaped bytes in the body, by a quick look (see
    _route_string); None when it does not look like one."""
    start = _route_string(raw, chat)
    end = _string_end(raw, start) if start is not None else None
    return None if start is None or end is None else (start, end)


def _route_string(raw: bytes, chat: bool) -> int | None:
    """Where the prompt's (or first message content's) string starts, by a quick look for its
    key; None if not found. A guess: the body parsed with it cut out must read the mark as
    its route text (read_cut)."""
    at = _expect(raw, 0, _CHAT_HEAD if chat else _COMPLETION_HEAD)
    if chat and at is not None:
        at = _expect(raw, at, _CONTENT_HEAD)
    return at


def _expect(raw: bytes, at: int, tokens: tuple[bytes, ...]) -> int | None:
    """The index after `tokens` (the first found from `at`, the rest after whitespace)."""
    first = raw.find(tokens[0], at)
    if first < 0:
        return None
    at = first + len(tokens[0])
    for token in tokens[1:]:
        at = _WHITESPACE.match(raw, at).end()  # type: ignore[union-attr]  # always matches
        if not raw.startswith(token, at):
            return None
        at += len(token)
    return at


def _string_end(raw: bytes, at: int) -> int | None:
    """The index of the quote that closes the string `at` is in (at an escape's boundary);
    None past MAX_QUOTES escaped quotes."""
    find = raw.find
    for _ in range(MAX_QUOTES):
        quote = find(b'"', at)
        if quote < 0:
            return None
        run = quote
        while run > at and raw[run - 1] == 0x5C:  # backslashes before the quote
            run -= 1
        if (quote - run) % 2 == 0:
            return quote
        at = quote + 1
    return None


def _decoded_head(raw: bytes, start: int, end: int, window: int) -> str:
    """The text of the escaped string raw[start:end], at least its first `window` UTF-8
    bytes: an escape takes at most 6 bytes per UTF-8 byte (\\u0001), so 6 * window bytes and
    a margin cover the window once a cut character or escape is dropped."""
    stop = start + 6 * window + 16
    if stop >= end:
        return _string(raw[start:end])
    head = raw[start:stop]
    if head[-1] >= 0x80:  # a character maybe cut: drop it
        head = head.rstrip(bytes(range(0x80, 0xC0)))[:-1]
    last = head.rfind(b"\\", len(head) - 6)
    if last >= 0:
        run = last - len(head[:last].rstrip(b"\\"))
        needed = 6 if head[last + 1 : last + 2] == b"u" else 2
        if run % 2 == 0 and len(head) - last < needed:  # an escape cut short
            head = head[:last]
    text = _string(head)
    if text and "\ud800" <= text[-1] <= "\udbff":  # half a surrogate pair
        text = text[:-1]
    return text


def _string(escaped: bytes) -> str:
    text = _loads(b'"' + escaped + b'"')
    assert isinstance(text, str)
    return text


def too_deep() -> FrontError:
    return bad_request(
        f"the body is not valid JSON: it nests deeper than the sidecar reads ({MAX_DEPTH} levels)"
    )


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:  # json's reader recurses once per level: 3,000 levels are 6 KB
        raise too_deep() from None
    except UnicodeDecodeError:
        raise bad_request("the body is not UTF-8 JSON") from None
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {str(exc)[:QUOTE_CHARS]}") from None


def _read(data: Any, chat: bool) -> FrontRequest:
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    stream = data.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad_request("stream must be a boolean", "stream")
    try:
        salt = checked_salt(data.get("cache_salt") or "")
    except ValueError as exc:
        raise bad_request(str(exc), "cache_salt") from None
    route_text = _first_message_text(data) if chat else _prompt_text(data)
    messages = _route_messages(data["messages"]) if chat else ()
    answers = _answers(data["messages"]) if chat else None
    return FrontRequest(model, route_text, bool(stream), messages, answers, cache_salt=salt)


def _route_messages(messages: list[Any]) -> tuple[tuple[str, str], ...]:
    """The messages organic routing chains, as (role, text): the first LEARN_MESSAGES + 1,
    as the Chat RPC gives them, so both fronts key a chat alike. The pod validates them."""
    found: list[tuple[str, str]] = []
    for message in messages[: LEARN_MESSAGES + 1]:
        item = message if isinstance(message, dict) else {}
        role = item.get("role")
        found.append((role if isinstance(role, str) else "", _content_text(item.get("content"))))
    return tuple(found)


def _answers(messages: list[Any]) -> int:
    """How many of the messages are the assistant's (one pass, no copy)."""
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _prompt_text(data: dict[str, Any]) -> str:
    """A string prompt routes as itself; a batch on its first prompt; token ids on their
    decimal text (the same ids meet on the same pod)."""
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):
            return _token_text(prompt)
        if isinstance(first, list) and first and all(isinstance(t, int) for t in first):
            return _token_text(first)
    raise bad_request(
        "prompt is required: a string, a list of strings or a list of token ids", "prompt"
    )


def _token_text(tokens: list[Any]) -> str:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("prompt token ids must be integers", "prompt")
    return ",".join(map(str, tokens))


def _first_message_text(data: dict[str, Any]) -> str:
    """The first message's text (a system message when there is one): where a fat prefix
    sits. Content parts count by their text parts, joined."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages is required: a non-empty list of messages", "messages")
    first = messages[0]
    if not isinstance(first, dict):
        raise bad_request("each message must be an object", "messages")
    content = first.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise bad_request("a message's content must be a string or a list of parts", "messages")
    return _content_text(content)
