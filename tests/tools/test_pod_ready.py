"""Waiting for a real engine's pod: up once it answers 200, an early error with the log tail
when its process exits, and a timeout with the log tail when it never answers."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from prefix_sidecar_tools.harness import free_port
from prefix_sidecar_tools.pod_ready import poll_until_ready
from prefix_sidecar_tools.vllm.pod import VllmPod
from tests.fake_pod import start_site


@dataclass
class Pod:
    url: str
    port: int
    process: asyncio.subprocess.Process | None = None
    log: str = "the log"

    def log_tail(self) -> str:
        return self.log


def nobody_listens() -> Pod:
    port = free_port()
    return Pod(f"http://127.0.0.1:{port}", port)


async def test_ready_once_the_pod_answers_200_after_refusing() -> None:
    answers = iter([503, 503])

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=next(answers, 200))

    app = web.Application()
    app.router.add_get("/health", health)
    runner, url = await start_site(app)
    try:
        async with aiohttp.ClientSession() as session:
            pod = Pod(url, int(url.rsplit(":", 1)[1]))
            waited = await poll_until_ready(session, pod, "/health", "test", 5, 0.05)
    finally:
        await runner.cleanup()
    assert 0.1 <= waited < 5  # two refusals, 0.05 s apart at least


async def test_an_exited_process_fails_at_once_with_its_log_tail() -> None:
    pod = nobody_listens()
    pod.process = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(3)")
    await pod.process.wait()
    expected = f"test pod on port {pod.port} exited with code 3; log tail:\nthe log"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(RuntimeError, match=expected):
            await poll_until_ready(session, pod, "/health", "test", 5, 1)


async def test_a_pod_that_never_answers_times_out_with_its_log_tail() -> None:
    pod = nobody_listens()
    expected = f"test pod on port {pod.port} not ready after 0 s; log tail:\nthe log"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TimeoutError, match=expected):
            await poll_until_ready(session, pod, "/health", "test", 0.3, 0.05)


def test_a_vllm_pods_log_tail_leads_with_its_first_error(tmp_path: Path) -> None:
    pod = VllmPod(port=1, core=0, scratch=tmp_path)
    lines = [f"start {i}" for i in range(60)]
    lines[5] = "(EngineCore pid=7) ERROR 12-06 the root cause"
    lines += [f"api server traceback {i}" for i in range(30)]
    pod.log_path.write_text("\n".join(lines))
    tail = pod.log_tail(lines=30).splitlines()
    assert tail[0] == "(EngineCore pid=7) ERROR 12-06 the root cause"
    assert tail[-1] == "api server traceback 29"
    assert "..." in tail and len(tail) == 40 + 1 + 30
    pod.log_path.write_text("\n".join(f"line {i}" for i in range(50)))
    assert pod.log_tail(lines=30).splitlines()[0] == "line 20"


async def test_a_niced_pod_runs_below_the_routers_in_its_own_session() -> None:
    """`nice`: the pod's processes and its session's autogroup (where the kernel has them)
    at that niceness; the caller's stays as it was."""
    # A short scratch folder: a pod refuses a TMPDIR too long for vLLM's ipc sockets, and a
    # parallel test worker's tmp_path is longer than that.
    with tempfile.TemporaryDirectory(prefix="nice-") as scratch:
        await _check_a_niced_pod(VllmPod(port=1, core=0, scratch=Path(scratch), nice=7))
    with pytest.raises(ValueError, match=r"0 \(unchanged\) to 19"):
        VllmPod(port=1, core=0, scratch=Path("/tmp"), nice=20)


async def _check_a_niced_pod(pod: VllmPod) -> None:
    await pod.start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"])
    assert pod.process is not None
    try:
        proc = Path(f"/proc/{pod.process.pid}")
        for _ in range(200):  # the orphan guard, then nice, exec into the command
            if "up" in pod.log_text():
                break
            await asyncio.sleep(0.05)
        assert b"time.sleep" in (proc / "cmdline").read_bytes()
        niceness = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[16])
        assert niceness == 7
        if (proc / "autogroup").exists():
            assert (proc / "autogroup").read_text().split()[-1] == "7"
        assert os.getpriority(os.PRIO_PROCESS, 0) != 7
    finally:
        await pod.stop(grace=2)
