"""A caller that went away: how its call is labelled, and no pod request sent for it after.

grpc.aio cancels a handler's task when its caller cancels, but it learns of the cancel
through the completion queue, one event at a time. A request that waited for a pod
connection (the per-pod limit, `per_backend_connections`) is woken when another request
ends, often before its own cancel has been read: it was sent to a busy pod for nobody (after
2,000 callers cancelled at once, 882 more requests reached the pod). So a request that had to
wait asks grpc core once more, right before its connection is made or reused: a read on its
call. Core answers in order, so a cancel it already knows is delivered first and the task is
cancelled there. A request that never waited pays nothing.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable

import grpc

# Less time than this left means the caller's deadline ended the call.
DEADLINE_SLACK_S = 0.01

_check: contextvars.ContextVar[Callable[[], Awaitable[object]] | None] = contextvars.ContextVar(
    "caller_check", default=None
)


def deadline_spent(remaining: float | None) -> bool:
    """Whether a call with `remaining` seconds left (None: no deadline) is out of time."""
    return remaining is not None and remaining < DEADLINE_SLACK_S


def ended_status(context: grpc.aio.ServicerContext) -> str:
    """The status of a call its caller ended: the deadline's, or a cancel."""
    if deadline_spent(context.time_remaining()):
        return grpc.StatusCode.DEADLINE_EXCEEDED.name
    return grpc.StatusCode.CANCELLED.name


def watch(context: grpc.aio.ServicerContext) -> None:
    """Check this call's caller before a queued pod request of this task is sent.

    A unary-stream call's request was read already: one more read is answered at once (end
    of stream), or after the cancel of a call core already knows is gone.
    """
    _check.set(context.read)


async def check_after_wait() -> None:
    """Called by a request that waited for a pod connection, once it has one and before it
    is sent: the task is cancelled here if its caller already left."""
    check = _check.get()
    if check is not None:
        await check()
