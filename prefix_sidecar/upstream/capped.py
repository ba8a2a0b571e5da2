"""Reading a pod's answer without trusting its size, its time or its redirects."""

from __future__ import annotations

from typing import Any

import aiohttp

READ_BYTES = 64 * 1024


class FetchError(Exception):
    """A bounded fetch got no 200 answer: the status or the error's class, in short."""


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes `limit` bytes (the rest is never read,
    so a pod cannot make us hold more than limit + one read)."""
    body = bytearray()
    while chunk := await response.content.read(READ_BYTES):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


async def fetch_capped(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    timeout_s: float,
    limit: int,
    json: Any = None,
    headers: dict[str, str] | None = None,
) -> bytes | None:
    """A pod's 200 answer, within `timeout_s`, no redirect followed; None when it is over
    `limit` bytes (see read_capped); FetchError on any other status or a failed exchange."""
    try:
        async with session.request(
            method,
            url,
            json=json,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            allow_redirects=False,
        ) as response:
            if response.status != 200:
                raise FetchError(f"HTTP {response.status}")
            return await read_capped(response, limit)
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise FetchError(exc.__class__.__name__) from None
