"""A Sidecar whose start fails half way releases everything it opened, so a supervisor that
retries (or a test that expects the failure) finds no server, session, socket file or task
left behind."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefix_sidecar.server.app import Sidecar

from .conftest import free_port, running_sidecar, sidecar_config

NO_POD = "http://127.0.0.1:9"  # never reached: start fails before membership is resolved


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A 127.0.0.1 port something else listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def other_tasks() -> set[asyncio.Task[object]]:
    return asyncio.all_tasks() - {asyncio.current_task()}


async def test_a_metrics_port_in_use_fails_start_and_leaves_nothing_open(
    tmp_path: Path, busy_port: int
) -> None:
    config = sidecar_config(tmp_path, [NO_POD], metrics_port=busy_port)
    tasks_before = other_tasks()
    sidecar = Sidecar(config)
    with pytest.raises(OSError):
        await sidecar.start()

    assert sidecar.server is not None
    timed_out = await sidecar.server.wait_for_termination(timeout=1.0)
    assert not timed_out, "the gRPC server still runs"
    assert not sidecar.pools.default.client.lean._idle, "a pod connection was left open"
    assert not os.path.exists(config.socket_path), "the socket file was left behind"
    assert other_tasks() <= tasks_before, "tasks were left running"
    assert sidecar.metrics_port is None

    # Nothing holds the socket path: a sidecar with a free metrics port starts in its place.
    retry = sidecar_config(tmp_path, [NO_POD], metrics_port=free_port())
    async with running_sidecar(retry, wait=False):
        assert os.path.exists(retry.socket_path)
    assert not os.path.exists(retry.socket_path)


async def test_async_with_a_failing_start_raises_and_cleans_up(
    tmp_path: Path, busy_port: int
) -> None:
    config = sidecar_config(tmp_path, [NO_POD], metrics_port=busy_port)
    sidecar = Sidecar(config)
    with pytest.raises(OSError):
        async with sidecar:
            pytest.fail("the body must not run")
    assert not os.path.exists(config.socket_path)
    assert not sidecar.pools.default.client.lean._idle, "a pod connection was left open"


async def test_stop_is_safe_twice_and_before_start(tmp_path: Path) -> None:
    config = sidecar_config(tmp_path, [NO_POD])
    never_started = Sidecar(config)
    await never_started.stop(grace_s=0)
    sidecar = Sidecar(config)
    await sidecar.start()
    await sidecar.stop(grace_s=0)
    await sidecar.stop(grace_s=0)
    assert not os.path.exists(config.socket_path)
