"""Reading a pod's answer without trusting its size."""

from __future__ import annotations

import aiohttp

READ_BYTES = 64 * 1024


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes `limit` bytes (the rest is never read,
    so a pod cannot make us hold more than limit + one read)."""
    body = bytearray()
    while chunk := await response.content.read(READ_BYTES):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)
