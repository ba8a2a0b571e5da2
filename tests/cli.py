"""The `prefix-sidecar` command as the tests start it: a child of this interpreter that
imports this checkout (the harness's `child_env`), run from the repository's root. `run_cli`
runs it to the end, its output captured as text and its time bounded; `start_cli` starts it
and leaves stopping it to the test. One way for every test of a command, so none of them
can start it against other code."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefix_sidecar_tools.harness import child_env, python_command

REPO = Path(__file__).resolve().parents[1]


def run_cli(
    *args: str,
    timeout: float = 60.0,
    stdin: str | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`prefix-sidecar ARGS` to the end; `env` is the child's whole environment (default:
    ours, this checkout first on PYTHONPATH)."""
    return subprocess.run(
        python_command("-m", "prefix_sidecar.cli", *args),
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(env) if env is not None else child_env(),
    )


async def start_cli(
    *args: str, env: Mapping[str, str] | None = None, **stdio: Any
) -> asyncio.subprocess.Process:
    """`prefix-sidecar ARGS` started and left running; `stdio` as for
    asyncio.create_subprocess_exec (stdout=PIPE, ...)."""
    return await asyncio.create_subprocess_exec(
        *python_command("-m", "prefix_sidecar.cli", *args),
        cwd=REPO,
        env=dict(env) if env is not None else child_env(),
        **stdio,
    )
