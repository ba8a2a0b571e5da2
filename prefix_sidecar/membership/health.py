"""Which backends may take traffic: active health checks plus passive request failures.

Per member (after Envoy's checker): `GET {url}{path}` every jittered `interval_s`, 2xx is
healthy; `failure_threshold` consecutive failures (active or passive) eject it. After a
failure it is rechecked in FAILURE_RECHECK_S (a passive one wakes it at once), so a sick pod
leaves in ~threshold x recheck. An idle TCP "liveness" connection per pod turns a dead process
into EOF within milliseconds and a recheck, so a dead pod leaves within 2 s without traffic.
New members are UNKNOWN until their first check; only an active check re-admits (a passive
success may predate the ejection).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prefix_sidecar.config import DEFAULTS
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError

logger = logging.getLogger(__name__)

ChangeCallback = Callable[[str, bool, "str | None"], None]
FAILURE_RECHECK_S = 0.2  # after a failure: a sick pod leaves in ~threshold x this
HEALTH_BODY_BYTES = 64 * 1024  # a healthy answer longer than this leaves with its connection


class MemberStatus(enum.Enum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    EJECTED = "ejected"


@dataclass
class _Tracked:
    url: str
    host: str
    port: int
    status: MemberStatus = MemberStatus.UNKNOWN
    failures: int = 0
    last_error: str | None = None
    last_check_started: float = -math.inf
    woken: bool = False  # a wake-up arrived since the last check started
    waker: asyncio.Future[None] | None = None  # resolved to end the current nap early
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def wake(self) -> None:
        """Ask for a check now (or right after the one in flight)."""
        self.woken = True
        _resolve(self.waker)

    async def nap(self, delay: float) -> None:
        """Sleep up to delay, less if woken. Not asyncio.wait_for(event.wait(), delay): on
        Python <= 3.11 it can swallow a cancel that lands with a wake-up
        (gh-86296), hanging run()."""
        if self.woken:
            return
        loop = asyncio.get_running_loop()
        self.waker = loop.create_future()
        timer = loop.call_later(delay, _resolve, self.waker)
        try:
            await self.waker
        finally:
            timer.cancel()
            self.waker = None


def _resolve(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class HealthMonitor:
    """Tracks the health of a changing set of backend urls and reports transitions."""

    def __init__(
        self,
        client: UpstreamClient,
        *,
        path: str = DEFAULTS.health_path,
        interval_s: float = DEFAULTS.health_interval_s,
        timeout_s: float = DEFAULTS.health_timeout_s,
        failure_threshold: int = DEFAULTS.eject_after_failures,
        on_change: ChangeCallback,
        watch_connections: bool = True,
    ) -> None:
        if not path.startswith("/"):
            raise ValueError(f"health path {path!r} must start with '/', e.g. '/health'")
        if not (interval_s > 0 and timeout_s > 0):
            raise ValueError("health interval_s and timeout_s must be > 0")
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self._client = client
        self._path = path
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._threshold = failure_threshold
        self._watch_connections = watch_connections
        self._on_change = on_change
        self._members: dict[str, _Tracked] = {}
        self._running = False
        self._stop = asyncio.Event()

    # --- queries -----------------------------------------------------------------------

    def healthy(self, url: str) -> bool:
        tracked = self._members.get(url)
        return tracked is not None and tracked.status is MemberStatus.HEALTHY

    def status(self, url: str) -> MemberStatus | None:
        tracked = self._members.get(url)
        return None if tracked is None else tracked.status

    def last_error(self, url: str) -> str | None:
        tracked = self._members.get(url)
        return None if tracked is None else tracked.last_error

    # --- membership and passive signals ------------------------------------------------

    def set_members(self, urls: Iterable[str]) -> None:
        """Check exactly these urls from now on; new ones start UNKNOWN."""
        wanted = list(dict.fromkeys(urls))
        added: list[_Tracked] = []
        for url in wanted:  # validate everything before changing anything
            if url not in self._members:
                parts = urlsplit(url)
                if parts.hostname is None or parts.port is None:
                    raise ValueError(f"health: {url!r} is not a canonical scheme://host:port url")
                added.append(_Tracked(url, parts.hostname, parts.port))
        for url in set(self._members) - set(wanted):
            for task in self._members.pop(url).tasks:
                task.cancel()
        for tracked in added:
            self._members[tracked.url] = tracked
            if self._running:
                self._start(tracked)

    def record_failure(self, url: str, error: str) -> None:
        """A request to url failed (connect error, reset, 5xx...): count it, recheck now."""
        tracked = self._members.get(url)
        if tracked is None:
            return  # removed meanwhile
        self._register_failure(tracked, f"request failed: {error}")
        if tracked.status is not MemberStatus.EJECTED:
            tracked.wake()

    def record_success(self, url: str) -> None:
        tracked = self._members.get(url)
        if tracked is not None and tracked.status is MemberStatus.HEALTHY:
            tracked.failures = 0
            tracked.last_error = None

    # --- lifecycle ---------------------------------------------------------------------

    async def run(self) -> None:
        """Check all members until cancelled or close() is called."""
        if self._running:
            raise RuntimeError("HealthMonitor.run() is already running")
        self._running = True
        self._stop.clear()
        try:
            for tracked in self._members.values():
                self._start(tracked)
            await self._stop.wait()
        finally:
            self._running = False
            tasks = [t for tracked in self._members.values() for t in tracked.tasks]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for tracked in self._members.values():
                tracked.tasks.clear()

    def close(self) -> None:
        """Stop checking; run() returns. The client belongs to the caller."""
        self._stop.set()
        for tracked in self._members.values():
            for task in tracked.tasks:
                task.cancel()

    # --- internals ---------------------------------------------------------------------

    def _start(self, tracked: _Tracked) -> None:
        tracked.tasks.append(asyncio.create_task(self._check_loop(tracked)))
        if self._watch_connections:
            tracked.tasks.append(asyncio.create_task(self._liveness_loop(tracked)))

    async def _check_loop(self, tracked: _Tracked) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # Wake-ups (passive failures, liveness EOF) may come in bursts: keep checks
            # at least FAILURE_RECHECK_S apart.
            await asyncio.sleep(
                max(0.0, tracked.last_check_started + FAILURE_RECHECK_S - loop.time())
            )
            tracked.woken = False
            await self._check(tracked)
            if tracked.failures and tracked.status is MemberStatus.HEALTHY:
                delay = FAILURE_RECHECK_S  # confirm or clear a failure quickly
            else:
                delay = self._interval_s * random.uniform(0.85, 1.0)
            await tracked.nap(delay)

    async def _check(self, tracked: _Tracked) -> None:
        tracked.last_check_started = asyncio.get_running_loop().time()
        error = await self._probe(tracked.url)
        if tracked is not self._members.get(tracked.url):
            return  # removed while the check was in flight
        if error is None:
            self._register_success(tracked)
        else:
            self._register_failure(tracked, error)

    async def _probe(self, url: str) -> str | None:
        """GET the health path once; None when healthy, else why not. No redirect is
        followed (it could point anywhere): a 3xx is a failure. A healthy answer is read
        (up to HEALTH_BODY_BYTES) so that its connection is kept for the next check."""
        try:
            answer = await self._client.fetch(
                "GET", url, self._path, timeout_s=self._timeout_s, limit=HEALTH_BODY_BYTES
            )
        except UpstreamError as exc:
            return f"GET {url}{self._path}: {exc.message}"
        if 200 <= answer.status < 300:
            return None
        return f"GET {url}{self._path} returned HTTP {answer.status}"

    def _register_success(self, tracked: _Tracked) -> None:
        tracked.failures = 0
        tracked.last_error = None
        if tracked.status is not MemberStatus.HEALTHY:
            was = tracked.status
            tracked.status = MemberStatus.HEALTHY
            logger.info("backend %s is healthy (was %s)", tracked.url, was.value)
            self._notify(tracked.url, True, None)

    def _register_failure(self, tracked: _Tracked, error: str) -> None:
        tracked.failures += 1
        tracked.last_error = error
        if tracked.status is MemberStatus.UNKNOWN:
            reason = error  # first check decides
        elif tracked.status is MemberStatus.HEALTHY and tracked.failures >= self._threshold:
            reason = f"{error} ({tracked.failures} consecutive failures)"
        else:
            return
        tracked.status = MemberStatus.EJECTED
        logger.warning("backend %s ejected: %s", tracked.url, reason)
        self._notify(tracked.url, False, reason)

    def _notify(self, url: str, healthy: bool, reason: str | None) -> None:
        try:
            self._on_change(url, healthy, reason)
        except Exception:
            logger.exception("health on_change callback failed for %s", url)

    async def _liveness_loop(self, tracked: _Tracked) -> None:
        """Hold one idle TCP connection to the pod; its close means: check now."""
        loop = asyncio.get_running_loop()
        while True:
            connected_at = loop.time()
            try:
                # No timeout: a blackholed pod just leaves this connect pending (the check
                # loop handles its health), and a bare await cancels cleanly.
                reader, writer = await asyncio.open_connection(tracked.host, tracked.port)
            except OSError:
                await asyncio.sleep(self._interval_s)  # down: the check loop deals with it
                continue
            try:
                while await reader.read(4096):
                    pass  # a server may say something (e.g. 408) before closing
            except OSError:
                pass
            finally:
                writer.close()
            tracked.wake()
            # Servers that close idle connections quickly must not make us spin.
            await asyncio.sleep(max(0.0, connected_at + self._interval_s - loop.time()))
