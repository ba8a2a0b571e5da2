"""Two shapes of long-lived things, and what ends a long-lived process.

- AsyncService (fleets, pods, sidecar processes in tests and benches): `async with thing:`
  calls `start()`, then `stop()` on exit and when `start()` fails half way.
- WokenPass (a background pass over the registered prefixes): woken by a registration or a
  membership change, one pass at a time, wake-ups during a pass coalesced; what needs its
  answer (a registration, its prefix's count) waits for `idle`.
- stop_signal: a process's first SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
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
        self._idle = asyncio.Event()
        self._idle.set()
        # Called once a pass ends with no wake-up pending: what waited for the pass goes on.
        self.idle_watchers: list[Callable[[], None]] = []

    def wake(self) -> None:
        self._idle.clear()
        self._wake.set()

    @property
    def busy(self) -> bool:
        """A pass runs or is asked for."""
        return not self._idle.is_set()

    async def idle(self, timeout_s: float) -> bool:
        """Waits, at most `timeout_s`, for the passes asked for so far to end; False if they
        had not."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.run_pass()
            if not self._wake.is_set():
                self._idle.set()
                for watcher in self.idle_watchers:
                    watcher()

    async def run_pass(self) -> None:
        raise NotImplementedError


async def stop_signal() -> None:
    """Return on the first SIGTERM or SIGINT; the running loop handles both from now on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
