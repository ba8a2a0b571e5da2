"""Waiting for a real engine's pod: up once it answers 200, an early error with the log tail
when its process exits, and a timeout with the log tail when it never answers."""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import pytest
from aiohttp import web

from prefix_sidecar_tools.harness import free_port
from prefix_sidecar_tools.pod_ready import poll_until_ready
from tests.fake_pod import start_site


async def test_ready_once_the_pod_answers_200_after_refusing() -> None:
    answers = iter([503, 503])

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=next(answers, 200))

    app = web.Application()
    app.router.add_get("/health", health)
    runner, base_url = await start_site(app)
    url = base_url + "/health"
    try:
        async with aiohttp.ClientSession() as session:
            waited = await poll_until_ready(
                session, url, None, what="pod", log_tail=str, timeout=5, poll_s=0.05
            )
    finally:
        await runner.cleanup()
    assert 0.1 <= waited < 5  # two refusals, 0.05 s apart at least


async def test_an_exited_process_fails_at_once_with_its_log_tail() -> None:
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(3)")
    await process.wait()
    url = f"http://127.0.0.1:{free_port()}/health"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(RuntimeError, match="pod 7 exited with code 3; log tail:\nboom"):
            await poll_until_ready(
                session, url, process, what="pod 7", log_tail=lambda: "boom", timeout=5, poll_s=1
            )


async def test_a_pod_that_never_answers_times_out_with_its_log_tail() -> None:
    url = f"http://127.0.0.1:{free_port()}/health"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TimeoutError, match="pod not ready after 0 s; log tail:\nquiet"):
            await poll_until_ready(
                session, url, None, what="pod", log_tail=lambda: "quiet", timeout=0.3, poll_s=0.05
            )
