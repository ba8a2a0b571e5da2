"""Waiting for a real engine's pod process (vLLM, llama.cpp) to answer over HTTP. One loop
for every fleet of real pods, so each fails the same way: early, with the pod's log tail,
when the process exits, and with the log tail again when it is still not up at the deadline."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

import aiohttp


class EnginePod(Protocol):
    """A pod process of a real engine, as its fleet keeps it."""

    url: str
    port: int
    process: asyncio.subprocess.Process | None

    def log_tail(self) -> str: ...


async def poll_until_ready(
    session: aiohttp.ClientSession,
    pod: EnginePod,
    path: str,
    engine: str,
    timeout: float,
    poll_s: float,
) -> float:
    """GET the pod's `path` every `poll_s` until it answers 200; the seconds that took.
    RuntimeError if its process exits first, TimeoutError after `timeout`, each naming the
    `engine` and the pod's port and carrying its log tail."""
    what = f"{engine} pod on port {pod.port}"
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if pod.process is not None and pod.process.returncode is not None:
            raise RuntimeError(
                f"{what} exited with code {pod.process.returncode}; log tail:\n{pod.log_tail()}"
            )
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(pod.url + path) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        await asyncio.sleep(poll_s)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s; log tail:\n{pod.log_tail()}")
