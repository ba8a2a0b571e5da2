"""Waiting for a real engine's pod process (vLLM, llama.cpp) to answer over HTTP. One loop
for every fleet of real pods, so each fails the same way: early, with the pod's log tail,
when the process exits, and with the log tail again when it is still not up at the deadline."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import aiohttp


async def poll_until_ready(
    session: aiohttp.ClientSession,
    url: str,
    process: asyncio.subprocess.Process | None,
    *,
    what: str,
    log_tail: Callable[[], str],
    timeout: float,
    poll_s: float,
) -> float:
    """GET `url` every `poll_s` until it answers 200; the seconds that took. `what` names the
    pod in the errors: RuntimeError if `process` exits first, TimeoutError after `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process is not None and process.returncode is not None:
            raise RuntimeError(
                f"{what} exited with code {process.returncode}; log tail:\n{log_tail()}"
            )
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(url) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        await asyncio.sleep(poll_s)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s; log tail:\n{log_tail()}")
