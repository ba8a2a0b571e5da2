"""Callers' connections and the process's file descriptors, shared by both fronts.

Every connection holds an fd. A process whose fds run out can no longer accept, open a pod
connection, or answer a health check: under systemd's default soft nofile of 1,024, 1,100
idle HTTP connections made every gRPC call time out. So, at start:
- the soft RLIMIT_NOFILE is raised to the hard limit (`raise_fd_limit`), as nginx's
  worker_rlimit_nofile and most servers do: the soft limit is only a default;
- each front gets a cap (`front_cap`) below what is left: at most 4,096 connections each
  (the gRPC front's `grpc.max_allowed_incoming_connections`), and together no more than
  three quarters of the fds, the last quarter (at least 64) kept for pod connections, the
  metrics server, logs and files. A connection over its front's cap is
  closed at once (the HTTP front answers it 503 first; grpc closes it in its core);
- a failing accept (EMFILE, ENFILE, ENOBUFS) is logged at most once per LOG_EVERY_S, with
  a count, not once per attempt: asyncio logs a traceback per failed accept, and 554k of
  them (246 MB) were written in 15 s (`install_accept_log`).
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
        """Log `message` with `args` and then the count of events quieted since the last
        line, or only count this one when a line went out less than `every_s` ago."""
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
    through an AcceptLog; every other context goes where it went before."""
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
