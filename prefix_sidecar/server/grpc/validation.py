"""Request validation: every field a caller sends is checked here before it is routed.

Each check raises `RpcAbort` with INVALID_ARGUMENT and a message that names the field, the
limit and the setting behind it (docs/api.md lists them), so a caller knows what to fix.
These functions only read the request: nothing here routes or touches a pod.
"""

from __future__ import annotations

import json
import math
from typing import Any

from prefix_sidecar.abort import invalid_argument

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOP = 16
MAX_STOP_BYTES = 1024
MAX_REPLICAS = 1024
MAX_SHOWN_ROLE_CHARS = 40


def text_field(value: str, field_name: str, limit: int, source: str = "") -> str:
    """Check a text field: valid UTF-8 (protobuf already rejects bad bytes) and size.
    `source` names the setting behind the limit, for the error message."""
    if len(value) > limit // 4:  # cheap check first: a char is at most 4 bytes
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise invalid_argument(
                f"{field_name} is {size} bytes; the maximum is {limit} bytes "
                f"({source or _limit_source(field_name)})"
            )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid_argument(
            f"{field_name} is not valid UTF-8 text (lone surrogate at character {exc.start})"
        ) from None
    return value


def _limit_source(field_name: str) -> str:
    return "config max_prefix_bytes" if "prefix" in field_name else "config max_input_bytes"


def registration_text(request: Any, max_prefix_bytes: int) -> str:
    """The checked text of a RegisterPrefixRequest (its name and replicas checked too)."""
    if not request.name:
        raise invalid_argument("name is empty; name the prefix")
    if request.replicas > MAX_REPLICAS:
        raise invalid_argument(f"replicas is {request.replicas}; the maximum is {MAX_REPLICAS}")
    return text_field(request.text, "prefix text", max_prefix_bytes)


def sampling_params(request: Any) -> dict[str, object]:
    """The sampling fields of a Complete or Chat request, as the pod's JSON wants them."""
    params: dict[str, object] = {}
    if request.max_tokens:
        params["max_tokens"] = request.max_tokens
    if request.HasField("temperature"):
        if not math.isfinite(request.temperature) or request.temperature < 0:
            raise invalid_argument(
                f"temperature is {request.temperature}; it must be a finite number >= 0"
            )
        params["temperature"] = request.temperature
    if request.HasField("top_p"):
        if not (0 < request.top_p <= 1):
            raise invalid_argument(f"top_p is {request.top_p}; it must be in (0, 1]")
        params["top_p"] = request.top_p
    if request.stop:
        if len(request.stop) > MAX_STOP or not all(request.stop):
            raise invalid_argument(
                f"stop must be 1-{MAX_STOP} non-empty strings, got {len(request.stop)}"
            )
        params["stop"] = [
            text_field(s, "stop", MAX_STOP_BYTES, "a fixed limit") for s in request.stop
        ]
    if request.HasField("seed"):
        params["seed"] = request.seed
    return params


def chat_messages(messages: Any, limit: int) -> list[dict[str, str]]:
    """Chat messages as the pod's JSON wants them; `limit` bounds their total UTF-8 bytes."""
    result = []
    total = 0
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            shown = message.role[:MAX_SHOWN_ROLE_CHARS]  # the caller's words reach a status
            raise invalid_argument(
                f"messages[{index}].role is {shown!r}; use one of {', '.join(CHAT_ROLES)}"
            )
        content = text_field(message.content, f"messages[{index}].content", limit)
        total += len(content.encode("utf-8"))
        result.append({"role": message.role, "content": content})
    if total > limit:
        raise invalid_argument(
            f"messages hold {total} bytes; the maximum is {limit} bytes (config max_input_bytes)"
        )
    return result


# Keys of the pod's body that the sidecar writes itself, per RPC.
OWNED_KEYS = {
    "Complete": ("prompt", "stream", "stream_options"),
    "Chat": ("messages", "stream", "stream_options"),
}
MAX_SHOWN_KEY_CHARS = 80
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
_JSON_TYPES[type(None)] = "null"


class _Members(list[tuple[str, Any]]):
    """A JSON object's members in order, duplicates kept (json's object_pairs_hook)."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (use a number or null)")


def extra_members(
    request: Any, rpc: str, params: dict[str, object], limit: int
) -> tuple[bytes, frozenset[str]]:
    """The members of request.extra_json, braces cut off, as the UTF-8 bytes the caller
    wrote (b"" when empty), and their keys. They are spliced into the pod's body unparsed:
    key order and number spelling reach the pod unchanged. A key the sidecar writes, a key
    also set by a typed field (in `params`, or model) and a repeated key are refused: the
    body must never hold one key twice."""
    text = text_field(request.extra_json, "extra_json", limit, "config max_input_bytes")
    if not text.strip(" \t\n\r"):
        return b"", frozenset()
    try:
        parsed = json.loads(text, object_pairs_hook=_Members, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise invalid_argument(
            f"extra_json is not valid JSON ({_clip(str(exc))}); send a JSON object such as "
            '{"response_format": {"type": "json_object"}}'
        ) from None
    if not isinstance(parsed, _Members):
        raise invalid_argument(
            f"extra_json is a JSON {_JSON_TYPES.get(type(parsed), 'value')}, not an object; "
            'send a JSON object such as {"n": 2}'
        )
    keys: set[str] = set()
    for key, _ in parsed:
        shown = _clip(key)
        if key in OWNED_KEYS[rpc]:
            raise invalid_argument(
                f"extra_json sets {shown!r}, which the sidecar writes itself; remove it"
            )
        if key == "cache_salt":
            raise invalid_argument(
                "extra_json sets 'cache_salt': set the request's cache_salt field instead "
                "(a salt keys the pods' cache, so routing must read it)"
            )
        if key in params or (key == "model" and request.model):
            raise invalid_argument(
                f"extra_json sets {shown!r} and so does the request's {key} field; "
                "set it in one place"
            )
        if key in keys:
            raise invalid_argument(f"extra_json sets {shown!r} twice; set it once")
        keys.add(key)
    members = text.strip(" \t\n\r")[1:-1].strip(" \t\n\r")
    return members.encode("utf-8"), frozenset(keys)


def _clip(text: str) -> str:
    """The caller's words reach a status: keep them short."""
    if len(text) <= MAX_SHOWN_KEY_CHARS:
        return text
    return text[:MAX_SHOWN_KEY_CHARS] + "..."
