"""Real processes: EmulatorFleet start/kill/restart, and the `emulate` command."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet, Faults, get_stats
from tests.cli import start_cli

from .conftest import post, prompt_of_tokens

ROOT = Path(__file__).resolve().parents[3]


async def emulate(*args: str) -> asyncio.subprocess.Process:
    """`prefix-sidecar emulate ARGS`, its stdout and stderr piped."""
    pipe = asyncio.subprocess.PIPE
    return await start_cli("emulate", *args, stdout=pipe, stderr=pipe)


async def is_answering(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)):
            return True
    except aiohttp.ClientError:
        return False


async def test_fleet_start_kill_restart(session: aiohttp.ClientSession) -> None:
    config = EmulatorConfig(model="m", time_scale=1000.0)
    async with EmulatorFleet(2, config) as fleet:
        assert len(set(fleet.urls)) == 2
        pids = [proc.pid for proc in fleet.processes if proc is not None]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        body = {"model": "m", "prompt": prompt_of_tokens(64), "max_tokens": 1}
        for _ in range(2):
            status, _ = await post(session, fleet.urls[1], "/v1/completions", body)
            assert status == 200
        assert (await get_stats(fleet.urls[1]))["cached_tokens"] == 48

        code = await fleet.kill(1)
        assert code == -signal.SIGKILL and not fleet.alive(1)
        assert not await is_answering(session, fleet.urls[1])
        assert await is_answering(session, fleet.urls[0])

        old_url = fleet.urls[1]
        assert await fleet.restart(1) == old_url  # same port
        assert fleet.alive(1)
        _, response = await post(session, fleet.urls[1], "/v1/completions", body)
        assert response["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # cold again
        procs = list(fleet.processes)
    assert all(proc is not None and proc.returncode is not None for proc in procs)


async def test_fleet_passes_config_and_fault_flags(session: aiohttp.ClientSession) -> None:
    config = EmulatorConfig(model="flagged", kv_tokens=4096, faults=Faults(unhealthy=True))
    async with EmulatorFleet(1, config) as fleet:
        async with session.get(fleet.urls[0] + "/health") as response:
            assert response.status == 503
        stats = await get_stats(fleet.urls[0])
        assert stats["model"] == "flagged" and stats["cache"]["capacity_blocks"] == 256


async def test_fleet_reports_a_port_in_use() -> None:
    async with EmulatorFleet(1, EmulatorConfig(time_scale=100.0)) as fleet:
        with pytest.raises(RuntimeError, match="exited with code 1"):
            async with EmulatorFleet(1, base_port=fleet.ports[0]):
                pass


async def test_emulate_command_starts_and_stops_cleanly(session: aiohttp.ClientSession) -> None:
    proc = await emulate("--pods", "2", "--base-port", "0", "--time-scale", "100")
    try:
        assert proc.stdout is not None
        line = b""
        while not line.startswith(b"PODS "):
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line, "emulate exited before printing its pods"
        urls = line.decode().split()[1].split(",")
        assert len(urls) == 2
        for url in urls:
            assert await is_answering(session, url)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        for url in urls:
            assert not await is_answering(session, url)  # children were stopped too
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_emulate_command_rejects_bad_flags() -> None:
    proc = await emulate("--pods", "2", "--decode-tps", "0")
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"decode_tps must be > 0" in err


async def test_pods_exit_when_their_parent_is_killed(session: aiohttp.ClientSession) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "prefix_sidecar.cli",
        "emulate",
        "--pods",
        "1",
        "--base-port",
        "0",
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = b""
    while not line.startswith(b"PODS "):
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line, "emulate exited before printing its pods"
    url = line.decode().split()[1]
    proc.kill()  # no chance to clean up: the pod must notice on its own (stdin EOF)
    await proc.wait()
    for _ in range(100):
        if not await is_answering(session, url):
            break
        await asyncio.sleep(0.05)
    assert not await is_answering(session, url)
