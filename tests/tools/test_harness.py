"""The one harness that starts and stops child processes (prefix_sidecar_tools/harness.py): the
orphan guard, SIGTERM-then-SIGKILL, the environment, and a sidecar's start and stop."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefix_sidecar_tools.harness import (
    EPHEMERAL_RANGE,
    LOWEST_PORT,
    SidecarProcess,
    child_env,
    free_port,
    group_running,
    guarded,
    python_command,
    spawn,
    spawn_blocking,
    terminate,
    terminate_blocking,
    terminate_group,
)

IGNORES_SIGTERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
NO_POD = "http://127.0.0.1:9"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_guard_execs_in_place_keeping_pid_and_exit_code() -> None:
    process = spawn_blocking(
        python_command("-c", "import os, sys; print(os.getpid()); sys.exit(3)"),
        stdout=subprocess.PIPE,
    )
    out, _ = process.communicate(timeout=20)
    assert process.returncode == 3
    assert int(out) == process.pid  # /proc/PID of the harness's child is the command itself


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_the_harness() -> None:
    """A harness killed with SIGKILL cannot clean up: the kernel SIGTERMs its children."""
    harness = (
        "import sys\n"
        "from prefix_sidecar_tools.harness import python_command, spawn_blocking\n"
        "child = spawn_blocking(python_command('-c', 'import time; time.sleep(60)'))\n"
        "print(child.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", harness],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=child_env(),
    )
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert alive(child_pid)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child_pid), "the child outlived its harness"
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait()


def test_guarded_wraps_the_command_without_preexec_fn() -> None:
    argv = guarded(["/bin/true", "x"])
    if sys.platform == "linux":
        assert argv[:2] == [sys.executable, "-c"] and argv[-2:] == ["/bin/true", "x"]
        assert argv[3] == str(os.getpid())
    else:
        assert argv == ["/bin/true", "x"]


def test_terminate_blocking_kills_what_ignores_sigterm() -> None:
    process = spawn_blocking(python_command("-c", IGNORES_SIGTERM), stdout=subprocess.PIPE)
    assert process.stdout is not None
    assert process.stdout.readline() == b"ready\n"
    started = time.monotonic()
    assert terminate_blocking(process, grace=0.3) == -signal.SIGKILL
    assert time.monotonic() - started < 5
    assert process.stdout.closed


async def test_terminate_sigterms_then_kills() -> None:
    polite = await spawn(python_command("-c", "import time; time.sleep(60)"))
    assert await terminate(polite, grace=5) == -signal.SIGTERM
    stubborn = await spawn(python_command("-c", IGNORES_SIGTERM), stdout=subprocess.PIPE)
    assert stubborn.stdout is not None
    assert await asyncio.wait_for(stubborn.stdout.readline(), 20) == b"ready\n"
    assert await terminate(stubborn, grace=0.3) == -signal.SIGKILL
    assert await terminate(stubborn, grace=0.3) == -signal.SIGKILL  # again: no error


# A leader that forks a worker and prints the worker's pid; `ignore` makes both ignore SIGTERM.
FORKS_A_WORKER = (
    "import os, signal, sys, time\n"
    "if sys.argv[1] == 'ignore':\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "if os.fork() == 0:\n"
    "    time.sleep(60)\n"
    "    os._exit(0)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize(("mode", "code"), [("obey", -signal.SIGTERM), ("ignore", -signal.SIGKILL)])
async def test_terminate_group_ends_the_leader_and_what_it_forked(mode: str, code: int) -> None:
    leader = await spawn(
        python_command("-c", FORKS_A_WORKER, mode),
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert leader.stdout is not None
    assert await asyncio.wait_for(leader.stdout.readline(), 20) == b"ready\n"
    assert group_running(leader.pid)
    assert await terminate_group(leader, grace=1.0) == code
    assert not group_running(leader.pid)  # the forked worker went too


def test_child_env_puts_this_checkout_first_and_can_drop_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PREFIX_SIDECAR_LOG_LEVEL", "debug")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    root = Path(__file__).resolve().parents[2]
    expected = [str(root), str(root / "tools"), "/elsewhere"]  # the runtime's, the tooling's
    assert child_env()["PYTHONPATH"] == os.pathsep.join(expected)
    assert child_env()["PREFIX_SIDECAR_LOG_LEVEL"] == "debug"
    clean = child_env(clean=True, EXTRA="1")
    assert "PREFIX_SIDECAR_LOG_LEVEL" not in clean and clean["EXTRA"] == "1"


async def test_a_sidecar_starts_serves_and_stops_cleanly(tmp_path: Path) -> None:
    sidecar = SidecarProcess(
        str(tmp_path / "s.sock"), ["--backend", NO_POD], log_path=str(tmp_path / "log")
    )
    async with sidecar:
        assert sidecar.process is not None and sidecar.process.returncode is None
        assert os.path.exists(sidecar.socket_path)
    assert sidecar.process.returncode == 0, sidecar.log_text()
    assert not os.path.exists(sidecar.socket_path)
    assert "prefix-sidecar stopped" in sidecar.log_text()
    assert await sidecar.stop() == 0  # idempotent


async def test_a_sidecar_that_fails_to_start_raises_with_its_log(tmp_path: Path) -> None:
    sidecar = SidecarProcess(
        str(tmp_path / "s.sock"),
        ["--backend", NO_POD, "--set", "grace_s=-1"],
        log_path=str(tmp_path / "log"),
    )
    with pytest.raises(RuntimeError, match="exited with code 2") as failure:
        await sidecar.start()
    assert "grace_s" in str(failure.value)  # the log tail names the bad field
    assert sidecar.process is not None and sidecar.process.returncode == 2


async def test_a_sidecar_not_ready_in_time_is_stopped(tmp_path: Path) -> None:
    """Ready also waits for the backends: a pod that never answers keeps it not ready."""
    sidecar = SidecarProcess(
        str(tmp_path / "s.sock"),
        ["--backend", NO_POD],
        log_path=str(tmp_path / "log"),
        start_timeout=2.0,
        backends_serving=1,
    )
    with pytest.raises(RuntimeError, match="not ready after 2 s"):
        await sidecar.start()
    assert sidecar.process is not None and sidecar.process.returncode is not None
    assert not os.path.exists(sidecar.socket_path)


@pytest.mark.skipif(not os.path.exists(EPHEMERAL_RANGE), reason="Linux's ephemeral range")
def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    """Below the range no outgoing connection or `bind 0` of another process can take the port
    between the pick and the bind (CI saw a vLLM pod lose its KV-event port that way)."""
    with open(EPHEMERAL_RANGE) as file:
        low = int(file.read().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST_PORT <= port < low for port in ports), ports
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))
