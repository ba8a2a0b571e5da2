"""Upstream request bodies that splice a registered prefix in without copying it.

A body is a few small parts around the prefix's one shared, pre-escaped bytes object, written
to the socket in order with an exact Content-Length, so in-flight requests do not each hold a
copy of the prefix (a 60k-token prefix is ~240 KB of JSON).
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any


class SplicedBody:
    """A JSON body made of byte parts, written in order; reusable across retries."""

    __slots__ = ("parts", "size")

    def __init__(self, *parts: bytes) -> None:
        self.parts = parts
        self.size = sum(len(part) for part in parts)  # the Content-Length

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def escape(text: str) -> bytes:
    """JSON string escaping without the quotes, as UTF-8: a per-character code with no
    codeword a prefix of another, so escape(a + b) == escape(a) + escape(b) and prefix
    matching can be done on escaped bytes."""
    # What json.dumps(text, ensure_ascii=False) calls for a str, without building an encoder.
    return encode_basestring(text)[1:-1].encode("utf-8")


# json.dumps with any non-default option builds a JSONEncoder per call; this is built once.
_JSON = json.JSONEncoder(ensure_ascii=False)


def _stream_tail(params: dict[str, Any], model: str, extra: bytes) -> tuple[bytes, ...]:
    """The body's members after the prompt or messages, and its closing brace. `extra` is
    the members of the caller's extra_json (validated, braces cut off): one more part,
    spliced in unparsed so the pod reads the caller's bytes."""
    rest: dict[str, Any] = dict(params)
    if model:
        rest["model"] = model
    rest["stream"] = True
    rest["stream_options"] = {"include_usage": True}
    tail = _JSON.encode(rest)[1:].encode("utf-8")
    if not extra:
        return (tail,)
    return tail[:-1] + b",", extra, b"}"


def completion_body(
    prefix: bytes | str,
    input_text: str,
    params: dict[str, Any],
    model: str,
    extra: bytes = b"",
) -> SplicedBody:
    """A streaming /v1/completions body: prompt = prefix + input. `prefix` is already
    JSON-escaped (PrefixEntry.json_bytes)."""
    if isinstance(prefix, str):
        prefix = prefix.encode("utf-8")
    tail = _stream_tail(params, model, extra)
    return SplicedBody(b'{"prompt":"', prefix, escape(input_text) + b'",' + tail[0], *tail[1:])


def chat_body(
    prefix: bytes,
    messages: list[dict[str, str]],
    params: dict[str, Any],
    model: str,
    extra: bytes = b"",
) -> SplicedBody:
    """A streaming /v1/chat/completions body; the prefix, if any, is the system message."""
    rest = b",".join(_JSON.encode(m).encode("utf-8") for m in messages)
    tail = _stream_tail(params, model, extra)
    closing = b"]," + tail[0]
    if not prefix:
        return SplicedBody(b'{"messages":[' + rest + closing, *tail[1:])
    return SplicedBody(
        b'{"messages":[{"role":"system","content":"',
        prefix,
        b'"}' + (b"," + rest if rest else b"") + closing,
        *tail[1:],
    )
