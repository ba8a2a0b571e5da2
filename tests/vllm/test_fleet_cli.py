"""`prefix-sidecar vllm-fleet`: starts real vLLM pods, prints their URLs, serves until its
stdin ends, then stops every pod with its workers (no process left behind).

Runs first in this folder (before the shared fleet starts), with one pod of its own.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import aiohttp

from prefix_sidecar_tools.harness import child_env, python_command, spawn, terminate
from tests.vllm.conftest import VLLM_TESTS, processes_within

pytestmark = VLLM_TESTS


async def test_the_verb_serves_pods_until_stdin_ends_and_leaves_no_process() -> None:
    # short, unlike tmp_path: vLLM's ipc sockets live under it (fleet.MAX_TMPDIR_CHARS)
    scratch = Path(tempfile.mkdtemp(prefix="vf-"))
    process = await spawn(
        python_command("-m", "prefix_sidecar.cli", "vllm-fleet", "--pods", "1"),
        env=child_env(clean=True, TMPDIR=str(scratch)),  # the fleet's scratch folder goes here
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        lines: list[str] = []
        while not lines or not lines[-1].startswith("PODS "):
            line = await asyncio.wait_for(process.stdout.readline(), 240)
            assert line, f"vllm-fleet ended before printing its pods: {lines}"
            lines.append(line.decode().strip())
        (url,) = lines[:-1]
        assert lines[-1] == f"PODS {url}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(f"{url}/health") as health:
                assert health.status == 200
            async with session.get(f"{url}/v1/models") as models:
                assert [m["id"] for m in (await models.json())["data"]] == ["tiny-llama"]
        assert processes_within(scratch), "the pod should run with its files in the scratch"

        process.stdin.close()
        assert await asyncio.wait_for(process.wait(), 60) == 0
        assert not processes_within(scratch)
    finally:
        await terminate(process, 30)
        shutil.rmtree(scratch, ignore_errors=True)
