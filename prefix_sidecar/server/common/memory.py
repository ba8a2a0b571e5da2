"""Give memory freed after a burst back to the OS.

After an abusive burst (HTTP/2 rapid reset) glibc keeps the freed heap pages mapped, so the
RSS a pod's memory limit counts stays at the peak. `malloc_trim(0)` returns every whole free
page of every arena; it runs every TRIM_INTERVAL_S in a thread (ctypes drops the GIL, so the
loop goes on), and only on glibc: elsewhere this is a no-op.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

TRIM_INTERVAL_S = 10.0


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


async def trim_forever() -> None:
    """Trim every TRIM_INTERVAL_S until cancelled (a task of the running sidecar)."""
    if _malloc_trim is None:
        logger.debug("malloc_trim is not available (not glibc): freed memory is not trimmed")
        return
    while True:
        await asyncio.sleep(TRIM_INTERVAL_S)
        await asyncio.to_thread(_malloc_trim, 0)
