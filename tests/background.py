"""A watcher that runs beside a test's traffic: `async with SomeWatch() as watch:` starts its
`watch()` loop as a task and stops it on exit, so each watcher writes only what it watches."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Self


class BackgroundWatch:
    """Runs `watch()` (a loop that never returns by itself) while the `async with` lasts."""

    _task: asyncio.Task[None] | None = None

    async def watch(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self.watch())
        await asyncio.sleep(0)  # the watch has started before the test goes on
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
