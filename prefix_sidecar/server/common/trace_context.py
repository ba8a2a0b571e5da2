"""The caller's trace context: `traceparent` and `x-request-id` from its gRPC metadata.

They are passed to the pod as HTTP headers and written in the request log, so a request can
be followed from the caller through the sidecar to vLLM. Both are untrusted: a value that is
not well formed is dropped (never repaired, never an error), so what reaches a pod's headers
or a log line is bounded, printable ASCII with no spaces.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

TRACEPARENT = "traceparent"
REQUEST_ID = "x-request-id"
MAX_REQUEST_ID_CHARS = 128

# W3C Trace Context, version 00: version-trace_id-parent_id-flags, lowercase hex.
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
# Visible ASCII only: no spaces (a log line is key=value pairs) and no control characters.
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")  # length is checked first
_ZERO_TRACE_ID = "0" * 32
_ZERO_PARENT_ID = "0" * 16


@dataclass(frozen=True, slots=True)
class TraceContext:
    """The well-formed trace headers of one call; "" for one absent or dropped."""

    traceparent: str = ""
    request_id: str = ""

    @classmethod
    def from_metadata(cls, metadata: Iterable[Any] | None) -> TraceContext:
        """Read them from `context.invocation_metadata()` (pairs of key, value). The first
        value of each key counts; a malformed one is dropped, not replaced by a later one."""
        traceparent = request_id = None
        for key, value in metadata or ():
            if key == TRACEPARENT and traceparent is None:
                traceparent = valid_traceparent(value)
            elif key == REQUEST_ID and request_id is None:
                request_id = valid_request_id(value)
        return cls(traceparent or "", request_id or "")

    def http_headers(self) -> dict[str, str]:
        """The headers to add to the pod request."""
        headers = {}
        if self.traceparent:
            headers[TRACEPARENT] = self.traceparent
        if self.request_id:
            headers[REQUEST_ID] = self.request_id
        return headers


def valid_traceparent(value: object) -> str:
    """`value` if it is a W3C version-00 traceparent with non-zero ids, else ""."""
    if not isinstance(value, str) or len(value) != 55:
        return ""
    match = _TRACEPARENT.fullmatch(value)
    if match is None or match[1] == _ZERO_TRACE_ID or match[2] == _ZERO_PARENT_ID:
        return ""
    return value


def valid_request_id(value: object) -> str:
    """`value` if it is 1-128 visible ASCII characters, else ""."""
    if not isinstance(value, str) or len(value) > MAX_REQUEST_ID_CHARS:
        return ""
    return value if _REQUEST_ID.fullmatch(value) else ""
