"""HealthMonitor against real aiohttp backends on 127.0.0.1, a closed port, and a real
server process killed with SIGKILL (a dead pod)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable

import pytest

from prefix_sidecar.membership.health import HealthMonitor, MemberStatus
from prefix_sidecar.upstream.client import UpstreamClient
from tests.fake_pod import start_site

from .conftest import Backend

Change = tuple[str, bool, "str | None"]


class Changes:
    """Records on_change calls with their time, and waits for a given one."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, Change]] = []
        self._event = asyncio.Event()

    def __call__(self, url: str, healthy: bool, reason: str | None) -> None:
        self.calls.append((time.monotonic(), (url, healthy, reason)))
        self._event.set()

    async def wait_for(
        self, url: str, healthy: bool, timeout: float = 3.0
    ) -> tuple[float, str | None]:
        """Return (time, reason) of the first not-yet-seen change of url to `healthy`."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for at, (u, h, reason) in self.calls[seen:]:
                if u == url and h == healthy:
                    self.calls.remove((at, (u, h, reason)))
                    return at, reason
            seen = 0
            self._event.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"no change {url} -> healthy={healthy} in {timeout}s: {self.calls}"
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._event.wait(), remaining)


MonitorFactory = Callable[..., tuple[HealthMonitor, Changes]]


@pytest.fixture
async def make_monitor() -> AsyncIterator[MonitorFactory]:
    client = UpstreamClient()
    runs: list[asyncio.Task[None]] = []

    def make(urls: list[str], **kwargs: object) -> tuple[HealthMonitor, Changes]:
        changes = Changes()
        monitor = HealthMonitor(client, on_change=changes, **kwargs)  # type: ignore[arg-type]
        monitor.set_members(urls)
        runs.append(asyncio.create_task(monitor.run()))
        return monitor, changes

    yield make
    for task in runs:
        task.cancel()
    await asyncio.gather(*runs, return_exceptions=True)
    await client.close()


async def test_first_check_decides(
    make_monitor: MonitorFactory, backend: Backend, closed_port: int
) -> None:
    dead = f"http://127.0.0.1:{closed_port}"
    monitor, changes = make_monitor([backend.url, dead])
    assert monitor.status(backend.url) is MemberStatus.UNKNOWN and not monitor.healthy(backend.url)
    await changes.wait_for(backend.url, True, timeout=1.0)
    _, reason = await changes.wait_for(dead, False, timeout=1.0)
    assert monitor.healthy(backend.url) and not monitor.healthy(dead)
    assert reason is not None and "cannot connect" in reason and "refused" in reason.lower()
    assert monitor.last_error(dead) == reason
    assert backend.hits[0] == "/health"


async def test_unhealthy_ejected_after_threshold_then_readmitted(
    make_monitor: MonitorFactory, backend: Backend
) -> None:
    monitor, changes = make_monitor([backend.url], interval_s=0.3)
    await changes.wait_for(backend.url, True)
    backend.status = 503
    flipped = time.monotonic()
    at, reason = await changes.wait_for(backend.url, False)
    assert reason == f"GET {backend.url}/health returned HTTP 503 (3 consecutive failures)"
    # 3 failures: the first within one interval, then two quick rechecks (0.2 s apart).
    assert at - flipped < 0.3 + 2 * 0.2 + 0.3
    backend.status = 200
    await changes.wait_for(backend.url, True, timeout=1.0)
    assert monitor.healthy(backend.url) and monitor.last_error(backend.url) is None


async def test_single_blip_does_not_eject(make_monitor: MonitorFactory, backend: Backend) -> None:
    monitor, changes = make_monitor([backend.url], interval_s=0.3)
    await changes.wait_for(backend.url, True)
    backend.status = 500
    hits = len(backend.hits)
    while len(backend.hits) == hits:  # exactly one failing check
        await asyncio.sleep(0.005)
    backend.status = 200
    await asyncio.sleep(0.8)
    assert changes.calls == [] and monitor.healthy(backend.url)


async def test_dead_pod_in_process_is_ejected_within_2s_with_defaults(
    make_monitor: MonitorFactory, backend: Backend
) -> None:
    _monitor, changes = make_monitor([backend.url])  # defaults: 2 s interval, threshold 3
    await changes.wait_for(backend.url, True)
    await asyncio.sleep(0.1)  # worst case for interval-only checking: just after a check
    died = time.monotonic()
    await backend.stop()
    at, reason = await changes.wait_for(backend.url, False, timeout=2.5)
    assert at - died < 2.0, f"ejected after {at - died:.2f}s"
    assert reason is not None and "cannot connect" in reason


SERVER = """
import asyncio, sys
from aiohttp import web
async def main():
    app = web.Application()
    app.router.add_get("/health", lambda request: web.Response(text="ok"))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def test_killed_pod_process_is_ejected_within_2s_with_defaults(
    make_monitor: MonitorFactory,
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVER, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        port = int(await asyncio.wait_for(proc.stdout.readline(), 10))
        url = f"http://127.0.0.1:{port}"
        _monitor, changes = make_monitor([url])
        await changes.wait_for(url, True)
        await asyncio.sleep(0.1)
        killed = time.monotonic()
        proc.kill()  # SIGKILL: no graceful shutdown, the kernel closes its sockets
        at, _ = await changes.wait_for(url, False, timeout=2.5)
        assert at - killed < 2.0, f"ejected after {at - killed:.2f}s"
        print(f"SIGKILLed pod ejected after {at - killed:.3f}s")
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_passive_failures_eject_and_active_check_readmits(
    make_monitor: MonitorFactory, backend: Backend
) -> None:
    monitor, changes = make_monitor([backend.url], interval_s=0.3)
    await changes.wait_for(backend.url, True)
    for _ in range(3):  # e.g. three requests reset mid-stream
        monitor.record_failure(backend.url, "stream reset")
    _, reason = await changes.wait_for(backend.url, False, timeout=0.1)
    assert reason == "request failed: stream reset (3 consecutive failures)"
    assert not monitor.healthy(backend.url)
    # /health still answers 200: the next active check re-admits it.
    await changes.wait_for(backend.url, True, timeout=1.0)


async def test_passive_success_resets_the_count(
    make_monitor: MonitorFactory, backend: Backend
) -> None:
    monitor, changes = make_monitor([backend.url], interval_s=5.0, watch_connections=False)
    await changes.wait_for(backend.url, True)
    monitor.record_failure(backend.url, "reset")
    monitor.record_failure(backend.url, "reset")
    monitor.record_success(backend.url)
    monitor.record_failure(backend.url, "reset")
    assert monitor.healthy(backend.url)
    assert monitor.last_error(backend.url) == "request failed: reset"


async def test_passive_failure_on_dead_pod_triggers_fast_recheck(
    make_monitor: MonitorFactory, backend: Backend
) -> None:
    # No liveness connection and a long interval: only the passive signal can be fast.
    monitor, changes = make_monitor([backend.url], interval_s=10.0, watch_connections=False)
    await changes.wait_for(backend.url, True)
    await backend.stop()
    failed = time.monotonic()
    monitor.record_failure(backend.url, "connection refused")
    at, reason = await changes.wait_for(backend.url, False, timeout=2.0)
    assert at - failed < 1.0
    assert reason is not None and "cannot connect" in reason


async def test_custom_health_path(make_monitor: MonitorFactory, backend: Backend) -> None:
    backend.status = 404  # this backend has no /health, only /v1/models
    _by_models, models_changes = make_monitor([backend.url], path="/v1/models")
    await models_changes.wait_for(backend.url, True)
    assert "/v1/models" in backend.hits
    _by_health, health_changes = make_monitor([backend.url])
    _, reason = await health_changes.wait_for(backend.url, False)
    assert reason == f"GET {backend.url}/health returned HTTP 404"


async def test_timeout_counts_as_failure(make_monitor: MonitorFactory, closed_port: int) -> None:
    from aiohttp import web

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/health", slow)
    runner, url = await start_site(app, access_log=None)
    try:
        _monitor, changes = make_monitor([url], timeout_s=0.2)
        _, reason = await changes.wait_for(url, False)
        assert reason == f"GET {url}/health: timed out after 0.2s"
    finally:
        await runner.cleanup()


async def test_set_members_adds_and_stops_checking(make_monitor: MonitorFactory) -> None:
    first, second = Backend(), Backend()
    await first.start()
    await second.start()
    try:
        monitor, changes = make_monitor([first.url], interval_s=0.1)
        await changes.wait_for(first.url, True)
        monitor.set_members([first.url, second.url])
        await changes.wait_for(second.url, True)
        monitor.set_members([second.url])
        await asyncio.sleep(0.15)
        hits = len(first.hits)
        await asyncio.sleep(0.4)
        assert len(first.hits) == hits, "removed member is still checked"
        assert len(second.hits) >= 3
        assert monitor.status(first.url) is None and not monitor.healthy(first.url)
        monitor.record_failure(first.url, "late failure for a removed member")  # ignored
    finally:
        await first.stop()
        await second.stop()


async def test_close_ends_run(backend: Backend) -> None:
    async with UpstreamClient() as client:
        monitor = HealthMonitor(client, on_change=lambda *_: None, interval_s=0.1)
        monitor.set_members([backend.url])
        run = asyncio.create_task(monitor.run())
        await asyncio.sleep(0.3)
        monitor.close()
        await asyncio.wait_for(run, 1.0)
        hits = len(backend.hits)
        await asyncio.sleep(0.3)
        assert len(backend.hits) == hits


def test_bad_settings_are_rejected() -> None:
    async def build(**kwargs: object) -> None:
        async with UpstreamClient() as client:
            HealthMonitor(client, on_change=lambda *_: None, **kwargs)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="must start with '/'"):
        asyncio.run(build(path="health"))
    with pytest.raises(ValueError, match="failure_threshold"):
        asyncio.run(build(failure_threshold=0))
