"""A watcher that runs beside a test's traffic: `async with SomeWatch() as watch:` starts its
`watch()` loop as a task and stops it on exit, so each watcher writes only what it watches."""

from __future__ import annotations

import asyncio
import contextlib
import time
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


class LoopWatch(BackgroundWatch):
    """The loop's longest step while it runs: a task that wakes every turn of the loop and
    measures, in the loop thread's CPU time (what another caller waits for; a busy box's
    preemption is not counted) and in wall time, how long it waited."""

    def __init__(self) -> None:
        self.cpu_ms = 0.0
        self.wall_ms = 0.0

    async def watch(self) -> None:
        while True:
            cpu, wall = time.thread_time(), time.perf_counter()
            await asyncio.sleep(0)
            self.cpu_ms = max(self.cpu_ms, (time.thread_time() - cpu) * 1e3)
            self.wall_ms = max(self.wall_ms, (time.perf_counter() - wall) * 1e3)
