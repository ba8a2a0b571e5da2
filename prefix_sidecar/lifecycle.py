"""One shape for things tests and benches start and stop: fleets, pods, sidecar processes.

`async with thing:` calls `start()`, and calls `stop()` both on exit and when `start()`
fails half way, so no child process or socket outlives a failed start.
"""

from __future__ import annotations

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
