"""What a pod's failure is, and whose fault: the one question the relay asks of it.

"May I try the next pod?" A refused connection, a timeout, a broken or malformed answer, a
3xx, a 5xx, a 429, a status no pod should send are the pod's (another pod may succeed);
only a 4xx other than 429 is the caller's request, which no pod would accept.
"""

from __future__ import annotations

import json

from prefix_sidecar.upstream.sse import POD_ERROR_CHARS, clip

MAX_ERROR_BYTES = 1024


def retryable_status(status: int) -> bool:
    """Whether another pod may succeed: False only for a 4xx other than 429 (the caller's
    request); 429 is an overloaded pod, and any other non-200 is the pod's fault (a 5xx, a
    3xx, a 2xx without a completion)."""
    return not 400 <= status < 500 or status == 429


class UpstreamError(Exception):
    """A pod could not serve the request. `retryable`: another pod may succeed."""

    def __init__(
        self,
        backend: str,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        connection_failure: bool = False,
    ) -> None:
        message = clip(message, MAX_ERROR_BYTES)  # a last guard; pod words are clipped first
        super().__init__(f"{backend}: {message}")
        self.backend = backend
        self.message = message
        self.retryable = retryable
        self.status = status
        self.connection_failure = connection_failure


def error_words(raw: bytes, reason: str) -> str:
    """What a pod's error body says: vLLM's {"message": ...} or {"error": {"message": ...}},
    else its text, else `reason`."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:POD_ERROR_CHARS] or reason
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:POD_ERROR_CHARS]
        if isinstance(error, str):
            return error[:POD_ERROR_CHARS]
        for key in ("message", "detail"):
            if data.get(key):
                return str(data[key])[:POD_ERROR_CHARS]
    return text[:POD_ERROR_CHARS]
