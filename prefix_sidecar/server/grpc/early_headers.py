"""Send a stream's response headers as soon as a pod accepts it, off the time to first token."""

from __future__ import annotations

import asyncio
import contextlib

import grpc


class EarlyHeaders:
    """Send a stream's response headers (initial metadata) once a pod accepted the request,
    while it works on the prompt.

    A grpc.aio client receives the headers and the first message in two steps, each a hop
    through its completion-queue thread; with the headers already there when the first
    chunk is written, that hop is off the time to first token. A task, so the relay is not
    held up; not before a pod accepted, so a call no pod takes still ends trailers-only.
    """

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._task: asyncio.Task[None] | None = None
        self.pending = False  # sent and not yet awaited

    def send(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._context.send_initial_metadata(())
            )
            self._task.add_done_callback(_retrieve_failure)
            self.pending = True

    async def settle(self) -> None:
        """Wait for the headers before anything else goes out on the call: grpc sends
        initial metadata once, and the first message or the status would add them again.
        Their failure is the call's, which the next step on the call reports."""
        if self.pending and self._task is not None:
            self.pending = False
            with contextlib.suppress(Exception):
                await self._task


def _retrieve_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # the call ended under the task: nothing to log
