"""Callers' connections and the process's file descriptors, shared by both fronts.

Every connection holds an fd, and a process out of fds can no longer accept, dial a pod or
answer a health check. So, at start:
- `raise_fd_limit` raises the soft RLIMIT_NOFILE to the hard limit, as most servers do;
- `front_cap` caps each front at 4,096 connections, and all together at three quarters of
  the fds: the last quarter (at least 64) is kept for pod connections, metrics, logs and
  files. Over its cap a connection is closed at once (the HTTP front answers 503 first);
- `install_accept_log` logs a failing accept (EMFILE, ENFILE, ENOBUFS) at most once per
  LOG_EVERY_S with a count, where asyncio would log a traceback per attempt.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

MAX_CONNECTIONS_PER_FRONT = 4096
FD_RESERVE_SHARE = 4  # a quarter of the fds are not for callers' connections
MIN_FD_RESERVE = 64
LOG_EVERY_S = 10.0
_ACCEPT_FAILED = "socket.accept() out of system resource"

logger = logging.getLogger(__name__)


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (no higher than the kernel takes);
    the soft limit in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        target = _nr_open()
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            logger.info("raised the soft nofile limit from %d to %d", soft, target)
            return target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the soft nofile limit from %d: %s", soft, exc)
    return soft


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as file:
            return int(file.read())
    except (OSError, ValueError):
        return 1 << 20


def front_cap(fronts: int, fd_limit: int | None = None) -> int:
    """The connections each of `fronts` fronts may hold, under the soft nofile limit in
    force (or `fd_limit`)."""
    if fd_limit is None:
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if fd_limit == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_PER_FRONT
    usable = fd_limit - max(MIN_FD_RESERVE, fd_limit // FD_RESERVE_SHARE)
    return max(1, min(MAX_CONNECTIONS_PER_FRONT, usable // max(1, fronts)))


class AcceptLog:
    """A warning that cannot flood: at most one line per LOG_EVERY_S, counting the rest."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._last = -float("inf")
        self._quiet = 0  # events since the last line

    def _line(self, level: int, message: str, *args: object) -> None:
        """Log `message` with `args` and the count quieted since the last line; within
        LOG_EVERY_S of that line, only count."""
        now = time.monotonic()
        if now - self._last < LOG_EVERY_S:
            self._quiet += 1
            return
        self._last = now
        quiet, self._quiet = self._quiet, 0
        self._log.log(level, message, *args, quiet)

    def over_cap(self, cap: int) -> None:
        self._line(
            logging.WARNING,
            "the HTTP front is at its %d connections: a new one was answered 503 and closed "
            "(%d more since the last such line)",
            cap,
        )

    def accept_failed(self, exc: BaseException | None) -> None:
        self._line(
            logging.ERROR,
            "accepting a connection failed: %s (%d more since the last such line; asyncio "
            "retries in 1 s)",
            exc,
        )


def install_accept_log(loop: asyncio.AbstractEventLoop) -> AcceptLog:
    """Route asyncio's per-attempt "socket.accept() out of system resource" tracebacks
    through an AcceptLog; every other context goes to the previous handler."""
    previous = loop.get_exception_handler()
    installed = getattr(previous, "accept_log", None)
    if isinstance(installed, AcceptLog):
        return installed  # once per loop (a sidecar restarted in the same loop)
    accept_log = AcceptLog(logger)

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == _ACCEPT_FAILED:
            accept_log.accept_failed(context.get("exception"))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handle.accept_log = accept_log  # type: ignore[attr-defined]
    loop.set_exception_handler(handle)
    return accept_log
