"""One real vLLM pod as a process group: its environment, start, readiness, stop and kill.

A pod is `.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server ...` (the argv comes
from `VllmFleet`), pinned to one core (`VLLM_CPU_OMP_THREADS_BIND`; by default every pod
binds core 0), with its temp files, caches and config under its own scratch folder (else
each start leaves ZMQ sockets in /tmp and a compile cache in the home directory). The API
server forks EngineCore and its worker into the pod's own process group, so `stop()` and
`kill()` end all three.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp

from prefix_sidecar_tools.harness import group_running, spawn, terminate_group
from prefix_sidecar_tools.pod_ready import poll_until_ready

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# vLLM puts ZMQ ipc sockets in TMPDIR, named by a 36-character uuid; a unix socket path has
# at most 107 bytes (sun_path), so a pod's TMPDIR may not be longer than this.
MAX_TMPDIR_CHARS = 107 - 37
# The highest niceness Linux gives a process (nice(2)).
MAX_NICENESS = 19
# Settings of ours, of the caller's venv, or of vLLM that must not reach a pod: vLLM's
# KV-space variable overrides --kv-cache-memory-bytes (and crashes the worker when empty).
DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE")


def vllm_env() -> dict[str, str]:
    """Our environment without what must not reach the vLLM venv's python, offline."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env.update(OFFLINE)
    return env


def lower_cpu_priority(argv: Sequence[str], nice: int) -> list[str]:
    """`argv` run at CPU niceness `nice` (0: unchanged); its children inherit it."""
    return ["nice", "-n", str(nice), *argv] if nice else list(argv)


def lower_session_share(pid: int, nice: int) -> None:
    """The autogroup of `pid`'s session at `nice`. With the kernel's autogroups on, CPU is
    shared between sessions first, so a process's own niceness ranks it only within its
    session; a pod runs in a session of its own. A kernel without autogroups: nothing."""
    if nice:
        with contextlib.suppress(FileNotFoundError):
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))


class VllmPod:
    """One vLLM API server on 127.0.0.1, pinned to `core`, its files under `scratch`;
    `extra_env` is added to its environment (vLLM's switches that are variables, such as
    VLLM_ALLOW_RUNTIME_LORA_UPDATING). `nice` lowers its CPU priority (0-19), so that the
    routers beside it on a small machine are not left waiting in the run queue behind its
    prefill and its idle polling (docs/real-engine.md)."""

    def __init__(
        self,
        port: int,
        core: int,
        scratch: Path,
        extra_env: Mapping[str, str] | None = None,
        nice: int = 0,
    ) -> None:
        if not 0 <= nice <= MAX_NICENESS:
            raise ValueError(f"nice={nice}: a pod's niceness is 0 (unchanged) to {MAX_NICENESS}")
        self.nice = nice
        self.port = port
        self.core = core
        self.url = f"http://127.0.0.1:{port}"
        self.scratch = scratch
        self.extra_env = dict(extra_env or {})
        self.log_path = scratch / "pod.log"
        self.process: asyncio.subprocess.Process | None = None
        self.ready_s = 0.0  # seconds from spawn to /health answering 200

    def env(self) -> dict[str, str]:
        tmp = self.scratch / "t"
        if len(str(tmp)) > MAX_TMPDIR_CHARS:
            raise ValueError(
                f"the pod's temp folder {tmp} is longer than {MAX_TMPDIR_CHARS} characters, "
                "too long for vLLM's ipc sockets: give the fleet a shorter scratch folder "
                "(or a shorter TMPDIR)"
            )
        tmp.mkdir(parents=True, exist_ok=True)
        env = vllm_env()
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=str(self.core),
            TMPDIR=str(tmp),
            VLLM_CACHE_ROOT=str(self.scratch / "cache"),
            VLLM_CONFIG_ROOT=str(self.scratch / "config"),
            HF_HOME=str(self.scratch / "hf"),
            VLLM_NO_USAGE_STATS="1",  # vLLM would otherwise report usage over the network
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    async def start(self, argv: Sequence[str]) -> None:
        self.scratch.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = await spawn(
                lower_cpu_priority(argv, self.nice),
                env=self.env(),
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # one process group: the server and its workers
            )
        lower_session_share(self.process.pid, self.nice)

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float) -> None:
        """Poll GET /health until it answers 200; fail early if the pod exits."""
        self.ready_s = await poll_until_ready(session, self, "/health", "vLLM", timeout, 0.25)

    async def stop(self, grace: float = 15.0) -> int | None:
        if self.process is None:
            return None
        return await terminate_group(self.process, grace)

    def freeze(self, frozen: bool) -> None:
        """SIGSTOP (or SIGCONT) the pod's whole process group: a frozen pod sends nothing
        more, so a caller can see what it had sent before it decides to kill it."""
        if self.process is None:
            raise RuntimeError(f"the pod at {self.url} was never started")
        os.killpg(self.process.pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    async def kill(self, timeout: float = 10.0) -> int:
        """SIGKILL the pod's whole process group, as a crash would; returns once no process
        of the group runs (EngineCore and its worker die with the server, not after it)."""
        process = self.process
        if process is None:
            raise RuntimeError(f"the pod at {self.url} was never started")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        code = await asyncio.wait_for(process.wait(), timeout)
        deadline = time.monotonic() + timeout
        while group_running(process.pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the pod at {self.url} outlived SIGKILL for {timeout} s")
            await asyncio.sleep(0.05)
        return code

    def log_text(self) -> str:
        try:
            return self.log_path.read_text("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        """The log's last `lines`, led by its first error (up to 40 lines) when that came
        earlier: vLLM's EngineCore prints the root cause of a failed start well before the
        API server's own traceback, which fills the tail."""
        text = self.log_text().splitlines()
        tail_from = max(0, len(text) - lines)
        first_error = next(
            (i for i, line in enumerate(text) if "Traceback" in line or " ERROR " in line), None
        )
        shown = text[tail_from:]
        if first_error is not None and first_error < tail_from:
            shown = [*text[first_error : min(first_error + 40, tail_from)], "...", *shown]
        return "\n".join(shown) or "(empty log)"
