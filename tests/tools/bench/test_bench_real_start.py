"""`bench real` starts its sidecar again on new ports when a port it was given is taken
before the sidecar binds it (real_systems._started): a real `prefix-sidecar serve` process
before one emulated pod, its first OpenAI port held by a listening socket."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest

from prefix_sidecar_tools.bench import real_systems
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator
from prefix_sidecar_tools.harness import free_port


@pytest.mark.timeout(120)
async def test_a_taken_port_has_the_sidecar_started_again_on_new_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    held = taken.getsockname()[1]
    ports = iter([held])
    monkeypatch.setattr(real_systems, "free_port", lambda: next(ports, None) or free_port())
    try:
        async with run_emulator() as pod, aiohttp.ClientSession() as session:
            fleet = SimpleNamespace(urls=[pod], model=EmulatorConfig().model)
            setup = real_systems.Setup(cast(Any, fleet), (), session, 1, 10.0, tmp_path)
            async with contextlib.AsyncExitStack() as stack:
                process, port, _ = await real_systems._started(stack, setup, (), str(tmp_path))
                assert port != held
                async with session.get(f"http://127.0.0.1:{port}/v1/models") as answer:
                    assert answer.status == 200
                assert process.process is not None and process.process.returncode is None
    finally:
        taken.close()
    # the start that failed left its log, which says why
    assert "in use" in (tmp_path / f"sidecar-{held}.log").read_text().lower()
    assert len(list(tmp_path.glob("sidecar-*.log"))) == 2
