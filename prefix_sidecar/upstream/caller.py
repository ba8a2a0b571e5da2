"""A caller that went away: how its call is labelled, and no pod request sent for it after.

grpc.aio learns of a cancel through the completion queue, so a request woken from the per-pod
connection wait (`per_backend_connections`) may run before its cancel is read and reach a busy
pod for nobody. A request that waited therefore reads its call once, right before its
connection is used: core answers in order, so a cancel it knows is delivered first and the
task is cancelled there. A request that never waited pays nothing.
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
