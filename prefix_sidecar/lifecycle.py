"""Two shapes of long-lived things.

- AsyncService, for what tests and benches start and stop (fleets, pods, sidecar processes):
  `async with thing:` calls `start()`, and calls `stop()` both on exit and when `start()`
  fails half way, so no child process or socket outlives a failed start.
- WokenPass, for a sidecar's background pass over its registered prefixes: woken after a
  registration or a membership change, one pass at a time, wake-ups during a pass coalesced.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Self


class AsyncService:
    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> object:
        """Release everything; safe after a partial start and when called twice. May return
        what the service ended with (a child process's exit code)."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


class WokenPass:
    def __init__(self) -> None:
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.run_pass()

    async def run_pass(self) -> None:
        raise NotImplementedError
