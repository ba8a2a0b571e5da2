"""The benches' helper processes (echo servers, proxies, frame servers, fast pods): each is a
`python -m MODULE` child that prints one `READY ...` line once it listens. Started here, one
way, so every bench waits for that line with the same bound and stops the child the same way
(SIGTERM, then SIGKILL) however the bench ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from prefix_sidecar_tools.harness import python_command, spawn, terminate

READY_TIMEOUT_S = 20


@contextlib.asynccontextmanager
async def ready_child(
    module: str, *args: str, what: str, wait_ready: bool = True
) -> AsyncIterator[tuple[asyncio.subprocess.Process, list[str]]]:
    """Run `python -m MODULE ARGS`; yield (the process, the words after READY) once it has
    printed its READY line (`wait_ready=False`: at once, with no words). `what` names the
    child in the error raised if it exits or speaks otherwise first."""
    process = await spawn(python_command("-m", module, *args), stdout=asyncio.subprocess.PIPE)
    try:
        words: list[str] = []
        if wait_ready:
            assert process.stdout is not None
            line = await asyncio.wait_for(process.stdout.readline(), READY_TIMEOUT_S)
            if line.split()[:1] != [b"READY"]:
                raise RuntimeError(f"{what} did not start; its stderr says why")
            words = line.decode().split()[1:]
        yield process, words
    finally:
        await terminate(process, 5)
