"""The bounded ways to read a pod's answer (prefix_sidecar.upstream.lean_http.PodAnswer):
the next bytes as the relays read them, a short body within a time (an error's words, the
end after [DONE]), and a whole body within a size (the control fetches).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from prefix_sidecar.upstream.errors import UpstreamError
from prefix_sidecar.upstream.lean_http import PodAnswer
from prefix_sidecar.upstream.pod_connection import PodHTTPError
from prefix_sidecar.upstream.sse import clip


async def read_from(answer: PodAnswer, backend: str, redact: Callable[[str], str]) -> bytes:
    """The answer's next bytes; UpstreamError (retryable: before the first token another pod
    may serve) when it breaks."""
    try:
        return await answer.read()
    except PodHTTPError as exc:
        raise UpstreamError(
            backend,
            f"stream broke: {clip(redact(str(exc)))}",
            retryable=True,
            connection_failure=exc.connection_failure,
        ) from None


async def read_capped(answer: PodAnswer, limit: int, timeout_s: float) -> bytes:
    """At most `limit` bytes of a (short) answer, in at most `timeout_s`; the rest is not
    read, and a broken answer gives what came before it."""
    parts: list[bytes] = []
    size = 0
    with contextlib.suppress(TimeoutError, PodHTTPError):
        async with asyncio.timeout(timeout_s):
            while size < limit and (data := await answer.read()):
                parts.append(data)
                size += len(data)
    return b"".join(parts)[:limit]


async def read_whole(
    answer: PodAnswer, backend: str, limit: int, redact: Callable[[str], str]
) -> bytes | None:
    """The whole body, or None as soon as it passes `limit` bytes (the rest is never read,
    so a pod cannot make us hold more than limit + one read); UpstreamError when it breaks."""
    parts: list[bytes] = []
    size = 0
    while data := await read_from(answer, backend, redact):
        size += len(data)
        if size > limit:
            return None
        parts.append(data)
    return b"".join(parts)
