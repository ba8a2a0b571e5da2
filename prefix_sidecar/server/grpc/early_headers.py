"""Send a stream's response headers as soon as a pod accepts it, off the time to first token."""

from __future__ import annotations

import asyncio
import contextlib

import grpc


class EarlyHeaders:
    """Send a stream's initial metadata once a pod accepted the request, while it prefills.

    A grpc.aio client takes the headers and the first message in two completion-queue hops;
    headers sent early take one hop off the time to first token. Sent from a task, so the
    relay is not held up; never before a pod accepted, so a call no pod takes ends
    trailers-only.
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
        """Wait for the headers before anything else goes out: otherwise the first message or
        the status would send initial metadata again. A failure here is the call's, reported
        by the call's next step."""
        if self.pending and self._task is not None:
            self.pending = False
            with contextlib.suppress(Exception):
                await self._task


def _retrieve_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # the call ended under the task: nothing to log
