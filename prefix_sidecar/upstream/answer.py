"""A pod's answer, the one type both fronts read whichever client fetched it.

`http://` pods answer through the llhttp client (prefix_sidecar.upstream.lean_http.LeanAnswer),
`https://` ones through aiohttp (AiohttpAnswer, here). Both read the body in the pieces the
socket gives, say when it is read to its end (`done`), and on `close()` keep the connection
only for an answer read whole, then free the pod's connection slot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Protocol

import aiohttp

from prefix_sidecar.upstream.errors import UpstreamError
from prefix_sidecar.upstream.pod_connection import PodHTTPError
from prefix_sidecar.upstream.sse import clip


class PodAnswer(Protocol):
    status: int
    headers: Mapping[str, str]  # names case-insensitive (lowercase in the lean client's)

    @property
    def done(self) -> bool: ...

    async def read(self) -> bytes:
        """The next body bytes; b"" at its end. PodHTTPError when the answer breaks."""
        ...

    def close(self) -> None:
        """Keep the connection if the answer was read whole, else close it; once."""
        ...


class AiohttpAnswer:
    """An aiohttp response read as a PodAnswer: for `https://` pods."""

    def __init__(self, response: aiohttp.ClientResponse, on_close: Callable[[], None]) -> None:
        self._response = response
        self._on_close: Callable[[], None] | None = on_close
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers  # case-insensitive
        self._ended = False

    @property
    def done(self) -> bool:
        return self._ended or self._response.content.is_eof()

    async def read(self) -> bytes:
        try:
            data = await self._response.content.readany()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise PodHTTPError(f"the answer broke: {exc.__class__.__name__}") from None
        except TimeoutError:  # the request's total timeout
            raise PodHTTPError("the upstream timeout expired mid-answer") from None
        self._ended = not data
        return data

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is None:
            return
        if self.done:
            self._response.release()  # read to its end: the connection is reused
        else:
            self._response.close()  # the pod's request ends now
        on_close()


async def read_from(answer: PodAnswer, backend: str, redact: Callable[[str], str] = str) -> bytes:
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
