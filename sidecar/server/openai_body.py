"""What the OpenAI HTTP front reads from a caller's body, and its errors in OpenAI's shape.

The body goes to the pod as the caller wrote it (unknown fields, key order, numbers): this
module only reads what routing needs - the model, the prompt or the first message, whether
the answer streams - and never re-serializes anything. One json.loads per request, on the
loop: a 240 KB prompt costs ~0.3 ms, a body at the 8 MiB default limit 5-10 ms (measured in
docs/api.md). A thread would not help: json.loads holds the GIL throughout, and measured
from a thread it held the loop longer (16 ms for 8 MiB) than inline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sidecar.routing.organic import LEARN_MESSAGES

# What of a caller's text may reach an error message.
QUOTE_CHARS = 80


class FrontError(Exception):
    """An HTTP error with OpenAI's body: {"error": {"message", "type", "param", "code"}};
    the openai SDK maps the status to its exception (400 BadRequestError, 404 NotFoundError,
    ...)."""

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
    route_text: str  # the prompt, or the first message's text
    stream: bool
    # A chat's messages as (role, text), the first LEARN_MESSAGES + 1: what organic routing
    # chains (routing contract 8d).
    messages: tuple[tuple[str, str], ...] = ()


def parse_request(raw: bytes, *, chat: bool) -> FrontRequest:
    """Parse once and read the routing fields; FrontError 400 on a body that is not a JSON
    object or lacks its prompt or messages."""
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("the body is not UTF-8 JSON") from None
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {str(exc)[:QUOTE_CHARS]}") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    stream = data.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad_request("stream must be a boolean", "stream")
    route_text = _first_message_text(data) if chat else _prompt_text(data)
    messages = _route_messages(data["messages"]) if chat else ()
    return FrontRequest(model, route_text, bool(stream), messages)


def _route_messages(messages: list[Any]) -> tuple[tuple[str, str], ...]:
    """The messages organic routing chains, as (role, text): the first LEARN_MESSAGES + 1,
    as the Chat RPC gives them, so both fronts key a chat alike. The pod validates them."""
    found: list[tuple[str, str]] = []
    for message in messages[: LEARN_MESSAGES + 1]:
        item = message if isinstance(message, dict) else {}
        role = item.get("role")
        found.append((role if isinstance(role, str) else "", _content_text(item.get("content"))))
    return tuple(found)


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
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    if content is None:
        return ""
    raise bad_request("a message's content must be a string or a list of parts", "messages")
