"""The one way request-path code says "end this RPC with this status and message".

Validation, routing and the relay raise it; the servicer turns it into `context.abort`.
The message reaches the caller as grpc-message, so it must say what to fix and be bounded.
"""

from __future__ import annotations

import grpc


class RpcAbort(Exception):
    """End the RPC with this status and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_argument(message: str) -> RpcAbort:
    """The caller's request is wrong; the message says how."""
    return RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, message)
