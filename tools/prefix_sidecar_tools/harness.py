"""Start and stop child processes for tests and tools: real `prefix-sidecar serve` sidecars
and the helpers around them (emulator pods, echo servers, load generators).

One way to do it, used by every bench, the fuzzer, the attack runner and the tests:
- every child is spawned behind the orphan guard, so a harness that crashes or is killed
  never leaves a sidecar behind;
- every child is stopped the same way: SIGTERM, up to `grace` seconds, then SIGKILL, reaped;
- a sidecar is ready when its health service answers SERVING (and, if asked, when every
  backend it was given is `serving`), so no caller hits a half-started sidecar.

The orphan guard is a `python -c` trampoline that sets PR_SET_PDEATHSIG and execs the real
command, not a `preexec_fn`: Python code run between fork and exec in a process with busy
grpc threads was seen to crash the child (SIGSEGV). The death signal is tied to the thread
that forked, so spawn from a thread that outlives the child (the event loop's thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prefix_sidecar.lifecycle import AsyncService
from prefix_sidecar_tools import IMPORT_ROOTS
from prefix_sidecar_tools.tuned import serve_settings

# argv after the code: the parent's pid, then the command to exec. If the parent died before
# prctl, the signal would never come: exit instead.
ORPHAN_GUARD = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)
KILLED_WITHIN_S = 2.0  # how long SIGKILLed processes may take to go
STDERR = "-"  # a log_path that means: the child writes to our stderr
SERVE = ("-m", "prefix_sidecar.cli")


# Ports are picked below the kernel's ephemeral range: a port the kernel picks (bind to 0)
# comes from that range, where every outgoing connection and every other `bind 0` of the
# processes started meanwhile draws too. CI saw a vLLM pod lose its KV-event port that way
# (ZMQError: Address already in use). Below the range only another explicit pick can collide.
LOWEST_PORT = 10_000
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, never handed out before by this process, and
    outside the ephemeral range where it can be (a later bind may still race another pick)."""
    low = _ephemeral_low()
    if low - LOWEST_PORT < 1_000:
        return _kernel_port()
    for _ in range(200):
        port = random.randrange(LOWEST_PORT, low)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    return _kernel_port()


@functools.cache  # the range is set at boot; read it once per process
def _ephemeral_low() -> int:
    try:
        with open(EPHEMERAL_RANGE) as file:
            return int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return LOWEST_PORT  # not Linux: only the kernel's pick is safe to use


def _kernel_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def guarded(argv: Sequence[str]) -> list[str]:
    """`argv` behind the orphan guard (Linux); unchanged elsewhere. The pid stays the same
    across the exec, so /proc/PID measures the command itself."""
    if sys.platform != "linux":
        return list(argv)
    return [sys.executable, "-c", ORPHAN_GUARD, str(os.getpid()), *argv]


def python_command(*args: str) -> list[str]:
    """`python ARGS` with this interpreter."""
    return [sys.executable, *args]


def child_env(clean: bool = False, **extra: str) -> dict[str, str]:
    """Our environment with this checkout's runtime and tooling first on PYTHONPATH, so a
    child imports the same code as its parent. `clean` drops PREFIX_SIDECAR_* settings
    leaking in from ours."""
    env = {k: v for k, v in os.environ.items() if not (clean and k.startswith("PREFIX_SIDECAR_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*IMPORT_ROOTS, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


async def spawn(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, **stdio: Any
) -> asyncio.subprocess.Process:
    """Start `argv` behind the orphan guard; stdin is /dev/null unless `stdin=` says."""
    stdio.setdefault("stdin", asyncio.subprocess.DEVNULL)
    return await asyncio.create_subprocess_exec(
        *guarded(argv), env=dict(env) if env is not None else child_env(), **stdio
    )


def spawn_blocking(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, **stdio: Any
) -> subprocess.Popen[Any]:
    """`spawn` for synchronous callers (the fuzzer, the attack runner's pods)."""
    stdio.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(
        guarded(argv), env=dict(env) if env is not None else child_env(), **stdio
    )


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, for a child that serves until it is told to stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def terminate(process: asyncio.subprocess.Process, grace: float) -> int:
    """SIGTERM, wait up to `grace` s, then SIGKILL; returns the exit code."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(process.wait(), grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        return await process.wait()


def group_running(pgid: int) -> bool:
    """True while a process of group `pgid` runs. Zombies do not count: a worker whose
    parent is gone waits to be reaped by init, which may take its time."""
    if sys.platform != "linux":
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


async def terminate_group(process: asyncio.subprocess.Process, grace: float) -> int:
    """`terminate` for a child spawned with `start_new_session=True` and everything it
    started: SIGTERM to its process group, wait up to `grace` s for the whole group to go,
    then SIGKILL what is left. For engines that fork workers (vLLM's EngineCore), which a
    signal to the leader alone can orphan. Returns the leader's exit code."""
    for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, KILLED_WITHIN_S)):
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), wait_s)
        while group_running(process.pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if process.returncode is not None and not group_running(process.pid):
            break
    return await process.wait()


def terminate_blocking(process: subprocess.Popen[Any], grace: float) -> int:
    """`terminate` for a `spawn_blocking` child; also closes its pipes."""
    if process.poll() is None:
        process.terminate()
    try:
        code = process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    return code


def serve_command(
    target: str, serve_args: Sequence[str], launcher: Sequence[str] = SERVE
) -> list[str]:
    """`python -m prefix_sidecar.cli serve --listen TARGET ARGS` (or another launcher of
    `serve`)."""
    return python_command(*launcher, "serve", "--listen", target, *serve_args)


class SidecarProcess(AsyncService):
    """`async with SidecarProcess(socket, ["--backend", url, ...]) as sidecar:` runs
    `prefix-sidecar serve --listen unix://SOCKET ARGS` and waits until it is SERVING.

    Its log (stderr and stdout) goes to `log_path` (a temp file by default, STDERR for ours),
    so tests can read what it logged and a chatty child never blocks on a full pipe.
    `launcher` replaces `-m prefix_sidecar.cli` (the soak runs `serve` under tracemalloc);
    `backends_serving` also waits until that many backends are `serving`.
    """

    def __init__(
        self,
        socket_path: str,
        serve_args: Sequence[str] = (),
        *,
        log_path: str | None = None,
        env: Mapping[str, str] | None = None,
        launcher: Sequence[str] = SERVE,
        start_timeout: float = 20.0,
        backends_serving: int = 0,
    ) -> None:
        self.socket_path = socket_path
        self.serve_args = list(serve_args)
        if log_path is None:
            handle, log_path = tempfile.mkstemp(prefix="sidecar-", suffix=".log")
            os.close(handle)
        self.log_path = log_path
        self.env = env
        self.launcher = list(launcher)
        self.start_timeout = start_timeout
        self.backends_serving = backends_serving
        self.process: asyncio.subprocess.Process | None = None

    @property
    def target(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("the sidecar process was not started")
        return self.process.pid

    def log_text(self) -> str:
        if self.log_path == STDERR:
            return ""
        try:
            return Path(self.log_path).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def send_signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(sig)

    async def start(self) -> None:
        """Spawn and wait until ready; a start that fails leaves no process behind."""
        argv = serve_command(self.target, self.serve_args, self.launcher)
        try:
            if self.log_path == STDERR:
                self.process = await spawn(argv, env=self.env)
            else:
                with open(self.log_path, "ab") as log:
                    self.process = await spawn(argv, env=self.env, stdout=log, stderr=log)
            await self._wait_ready()
        except BaseException:
            await self.stop(grace=1.0)
            raise

    async def stop(self, grace: float = 15.0) -> int:
        """SIGTERM, wait up to `grace` s (then SIGKILL); returns the exit code. Idempotent."""
        if self.process is None:
            return 0
        return await terminate(self.process, grace)

    async def _wait_ready(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from prefix_sidecar.v1 import router_pb2, router_pb2_grpc

        deadline = time.monotonic() + self.start_timeout
        last = "not started"
        async with grpc.aio.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            router = router_pb2_grpc.RouterStub(channel)
            while True:
                assert self.process is not None
                if self.process.returncode is not None:
                    raise RuntimeError(
                        f"the sidecar exited with code {self.process.returncode} before it was "
                        f"ready; its log:\n{self._log_tail()}"
                    )
                if os.path.exists(self.socket_path):
                    try:
                        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                        last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            if not self.backends_serving:
                                return
                            listed = await router.ListBackends(
                                router_pb2.ListBackendsRequest(), timeout=1.0
                            )
                            states = [b.state for b in listed.backends]
                            last = f"backends {states}"
                            if states.count("serving") == len(states) == self.backends_serving:
                                return
                    except grpc.aio.AioRpcError as exc:
                        last = exc.code().name
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the sidecar was not ready after {self.start_timeout:g} s (last: "
                        f"{last}); its log:\n{self._log_tail()}"
                    )
                await asyncio.sleep(0.05)

    def _log_tail(self) -> str:
        return self.log_text()[-3000:] or f"(see {self.log_path})"


class SidecarProcesses(AsyncService):
    """`async with SidecarProcesses(k, backends, policy) as sidecars:` then `sidecars.targets`:
    K sidecar processes in front of one fleet, each on its own socket in a private temp dir,
    ready when every backend is `serving` in each.

    Processes, not coroutines in the caller's loop: a load generator must not share an
    interpreter (and a GIL) with the router it measures, and K sidecars sharing traffic are K
    processes in production.
    """

    def __init__(
        self,
        count: int,
        backends: Sequence[str],
        policy: str = "prefix_affinity",
        settings: Mapping[str, object] | None = None,
        start_timeout_s: float = 30.0,
        stderr_path: str | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"need at least one sidecar process, got {count}")
        self.count = count
        self.backends = list(backends)
        self.policy = policy
        self.settings = {"health_interval_s": 0.5, "log_level": "warning", **(settings or {})}
        self.start_timeout_s = start_timeout_s
        self.stderr_path = stderr_path  # the sidecars' logs go here instead of our stderr
        self.sidecars: list[SidecarProcess] = []
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def targets(self) -> list[str]:
        return [sidecar.target for sidecar in self.sidecars]

    async def start(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="prefix-sidecar-bench-")
        settings, launcher = serve_settings({"policy": self.policy, **self.settings})
        args = [*(arg for url in self.backends for arg in ("--backend", url)), *settings]
        self.sidecars = [
            SidecarProcess(
                f"{self._dir.name}/sidecar-{i}.sock",
                args,
                launcher=launcher,
                log_path=self.stderr_path or STDERR,
                start_timeout=self.start_timeout_s,
                backends_serving=len(self.backends),
            )
            for i in range(self.count)
        ]
        # Every start runs to its end (each cleans up after itself) before the first error.
        results = await asyncio.gather(
            *(sidecar.start() for sidecar in self.sidecars), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def stop(self, grace_s: float = 5.0) -> None:
        await asyncio.gather(*(sidecar.stop(grace_s) for sidecar in self.sidecars))
        self.sidecars.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


__all__ = [
    "STDERR",
    "SidecarProcess",
    "SidecarProcesses",
    "child_env",
    "group_running",
    "guarded",
    "python_command",
    "serve_command",
    "spawn",
    "spawn_blocking",
    "terminate",
    "terminate_blocking",
    "terminate_group",
]
