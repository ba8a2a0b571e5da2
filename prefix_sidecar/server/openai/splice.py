"""Edits of a caller's body on the OpenAI front: a registered prefix spliced in, an alias
model name replaced by the pool's own.

With `x-prefix-id` or `x-prefix-name` the caller sends only the thin query; the prefix's
escaped bytes (PrefixEntry.json_bytes) go in front of the prompt, or as a system message
before the messages, as on the gRPC path. Nothing is re-serialized: the walk below finds
where the top-level value starts and inserts there. Thin bodies are small, so it is cheap.
"""

from __future__ import annotations

import json
import re
from typing import Any

from prefix_sidecar.server.openai.body import bad_request

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
SYSTEM_HEAD = b'{"role":"system","content":"'


def splice_prefix(raw: bytes, prefix: bytes, *, chat: bool) -> bytes:
    """`raw` with `prefix` (JSON-escaped, no quotes) at the head of its prompt string, or
    as a system message first in its messages; FrontError 400 when the body has no such
    value to splice into."""
    text = raw.decode("utf-8")
    name = "messages" if chat else "prompt"
    found = _top_level_value(text, name)
    if found is None:
        raise bad_request(f"{name} is required", name)
    value, start = found
    if chat:
        if not isinstance(value, list) or not value:
            raise bad_request("messages must be a non-empty list after the prefix", name)
        at = _byte_offset(raw, text, start) + 1  # just inside the '['
        return raw[:at] + SYSTEM_HEAD + prefix + b'"},' + raw[at:]
    if not isinstance(value, str):
        raise bad_request("with a prefix header the prompt must be a string", name)
    at = _byte_offset(raw, text, start) + 1  # just inside the opening quote
    return raw[:at] + prefix + raw[at:]


def rename_model(raw: bytes, model: str) -> bytes:
    """`raw` with its top-level model (an alias of the pool's) replaced by `model`, every
    other byte as written; FrontError 400 when the body has no string model."""
    text = raw.decode("utf-8")
    found = _top_level_value(text, "model")
    if found is None or not isinstance(found[0], str):
        raise bad_request("model must be a string", "model")
    start = found[1]
    _, close = json.decoder.scanstring(text, start + 1)  # type: ignore[attr-defined]
    at, end = _byte_offset(raw, text, start), _byte_offset(raw, text, close)
    return raw[:at] + json.dumps(model).encode() + raw[end:]


def _top_level_value(text: str, wanted: str) -> tuple[Any, int] | None:
    """(value, index where it starts in `text`) of the object's member `wanted`; the last
    one when the key repeats, as json.loads reads it. Nested keys are not looked at."""
    found: tuple[Any, int] | None = None
    i = _skip(text, 0)
    if text[i : i + 1] != "{":
        raise bad_request("the body must be a JSON object")
    i = _skip(text, i + 1)
    if text[i : i + 1] == "}":
        return None
    try:
        while True:
            if text[i : i + 1] != '"':
                raise ValueError("a member name was expected")
            key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
            i = _skip(text, i)
            if text[i : i + 1] != ":":
                raise ValueError("':' was expected")
            start = _skip(text, i + 1)
            value, i = _DECODER.raw_decode(text, start)
            if key == wanted:
                found = (value, start)
            i = _skip(text, i)
            separator = text[i : i + 1]
            i = _skip(text, i + 1)
            if separator == "}":
                return found
            if separator != ",":
                raise ValueError("',' or '}' was expected")
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {str(exc)[:80]}") from None


def _skip(text: str, index: int) -> int:
    """The index after any JSON whitespace at `index`."""
    return _WHITESPACE.match(text, index).end()  # type: ignore[union-attr]  # always matches


def _byte_offset(raw: bytes, text: str, index: int) -> int:
    """The byte offset in `raw` (UTF-8) of character `index` of `text`."""
    return index if raw.isascii() else len(text[:index].encode("utf-8"))
