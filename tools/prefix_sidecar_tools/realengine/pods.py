"""Run real llama.cpp pods (llama-cpp-python's OpenAI server) and read their cache reuse.

API (used by tests/tools/realengine and `prefix-sidecar bench real`):

    async with LlamaFleet(model_path, n=3, n_ctx=4096) as fleet:
        fleet.urls                      # ["http://127.0.0.1:PORT", ...], one per pod
        pod = fleet.pod_for(url)        # LlamaPod: .url .port .log_path
        mark = pod.log_offset()         # byte offset in the pod's log, before a request
        ...send requests...
        pod.prompt_evals(since=mark)    # [PromptEval(evaluated, reused, ...)] per request
        fleet.prompt_evals()            # {url: [PromptEval, ...]} for the whole run
        await fleet.restart()           # same ports, cold caches, fresh logs

Why the log: llama-cpp-python reports no `cached_tokens`, but with verbose=True every
completion prints what it reused and what it computed (0.3.x, read from its source):

    Llama._create_completion: cache hit             <- state restored from the RAM cache
    Llama.generate: 2001 prefix-match hit, remaining 2 prompt tokens to eval
    llama_perf_context_print: prompt eval time =  80.51 ms /  2003 tokens (...)
    llama_perf_context_print:       total time =  84.13 ms /  2008 tokens

A pod serves one completion at a time (the server holds a lock around the model), so
the records in one pod's log are in request order and never interleave.

Cache settings: the server always keeps the KV cache of its last prompt and reuses the
longest common token prefix with the next one. `cache_bytes > 0` adds its LlamaRAMCache
(`--cache true --cache_type ram --cache_size N`): an LRU of saved states keyed by
prompt+completion tokens, so a pod can hold several prefixes. Each request saves a new
entry, so entries of one prefix crowd out another's; size it with `state_bytes()`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from prefix_sidecar.lifecycle import AsyncService
from prefix_sidecar_tools.harness import child_env, free_port, spawn, terminate
from prefix_sidecar_tools.pod_ready import poll_until_ready

_PREFIX_MATCH = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt")
_RAM_CACHE_HIT = "Llama._create_completion: cache hit"
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_TOTAL_TIME = re.compile(r"llama_perf_context_print:\s+total time =\s*([\d.]+) ms")


@dataclass(frozen=True)
class PromptEval:
    """What one completion cost a pod, as its log tells it."""

    evaluated: int  # prompt tokens the pod computed (prefill)
    reused: int  # prompt tokens taken from its KV cache (last prompt or RAM cache)
    ram_cache_hit: bool  # True when the state came from the LlamaRAMCache
    prompt_eval_ms: float
    total_ms: float

    @property
    def prompt_tokens(self) -> int:
        return self.evaluated + self.reused


def parse_prompt_evals(log_text: str) -> list[PromptEval]:
    """Parse a pod log (or a slice of it) into one PromptEval per finished completion.

    A record closes at the perf "total time" line; a prefix-match line or RAM-cache hit
    seen since the previous record belongs to it. The evaluated count is the prefix-match
    "remaining" number when present (exact), else the perf prompt-eval count (a cold
    prompt, which llama.cpp evaluates in full).
    """
    records: list[PromptEval] = []
    reused: int | None = None
    remaining: int | None = None
    ram_hit = False
    eval_ms, eval_tokens = 0.0, 0
    for line in log_text.splitlines():
        if _RAM_CACHE_HIT in line:
            ram_hit = True
        elif match := _PREFIX_MATCH.search(line):
            reused, remaining = int(match.group(1)), int(match.group(2))
        elif match := _PROMPT_EVAL.search(line):
            eval_ms, eval_tokens = float(match.group(1)), int(match.group(2))
        elif match := _TOTAL_TIME.search(line):
            records.append(
                PromptEval(
                    evaluated=remaining if remaining is not None else eval_tokens,
                    reused=reused or 0,
                    ram_cache_hit=ram_hit,
                    prompt_eval_ms=eval_ms,
                    total_ms=float(match.group(1)),
                )
            )
            reused, remaining, ram_hit, eval_ms, eval_tokens = None, None, False, 0.0, 0
    return records


def llama_cpp_available() -> bool:
    """True when `python -m llama_cpp.server` can run in this interpreter."""
    return all(importlib.util.find_spec(m) is not None for m in ("llama_cpp", "uvicorn"))


def state_bytes(prompt_tokens: int, layers: int = 2, kv_dim: int = 64, vocab: int = 1024) -> int:
    """Estimate one saved llama state: f16 K and V per token and layer, plus logits (checked
    against a measured state in docs/benchmarks.md)."""
    return prompt_tokens * layers * 2 * kv_dim * 2 + vocab * 4 + 64 * 1024


class LlamaPod:
    """One `python -m llama_cpp.server` process on 127.0.0.1, its log in a file."""

    def __init__(self, port: int, log_path: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, argv: list[str]) -> None:
        env = child_env(PYTHONUNBUFFERED="1")  # log lines in order, on time
        with self.log_path.open("wb") as log:
            self.process = await spawn(argv, env=env, stdout=log, stderr=asyncio.subprocess.STDOUT)

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float) -> None:
        """Poll GET /v1/models (the server has no /health) until it answers 200."""
        await poll_until_ready(session, self, "/v1/models", "llama.cpp", timeout, 0.1)

    async def stop(self, grace: float = 5.0) -> None:
        if self.process is not None:
            await terminate(self.process, grace)

    def log_offset(self) -> int:
        """Current size of the log; pass to prompt_evals(since=) to see later requests."""
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def prompt_evals(self, since: int = 0) -> list[PromptEval]:
        with self.log_path.open("rb") as log:
            log.seek(since)
            return parse_prompt_evals(log.read().decode("utf-8", errors="replace"))

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])


class LlamaFleet(AsyncService):
    """N llama.cpp pods serving one GGUF; started on enter, terminated on exit."""

    def __init__(
        self,
        model_path: str | Path,
        n: int = 3,
        n_ctx: int = 4096,
        *,
        cache_bytes: int = 0,
        n_threads: int = 1,
        log_dir: str | Path | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise FileNotFoundError(
                f"model {self.model_path} not found; create it with "
                "`python -m prefix_sidecar_tools.realengine.gguf_model OUT.gguf`"
            )
        if n < 1:
            raise ValueError(f"n={n}: a fleet needs at least one pod")
        self.n = n
        self.n_ctx = n_ctx
        self.cache_bytes = cache_bytes
        self.n_threads = n_threads
        self.startup_timeout = startup_timeout
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="llama-pods-"))
        self.pods: list[LlamaPod] = []

    @property
    def urls(self) -> list[str]:
        return [pod.url for pod in self.pods]

    def pod_for(self, url: str) -> LlamaPod:
        for pod in self.pods:
            if pod.url == url.rstrip("/"):
                return pod
        raise KeyError(f"{url} is not a pod of this fleet ({self.urls})")

    def prompt_evals(self) -> dict[str, list[PromptEval]]:
        return {pod.url: pod.prompt_evals() for pod in self.pods}

    def server_argv(self, port: int) -> list[str]:
        """The command line of one pod; kept light: one thread, last-token logits only."""
        argv = [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(self.model_path),
            "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(self.n_ctx),
            "--n_threads", str(self.n_threads),
            "--n_threads_batch", str(self.n_threads),
            # the server defaults to logits for every prompt token (for logprobs): a
            # n_ctx x vocab buffer per pod and per saved state; we only sample.
            "--logits_all", "false",
            "--verbose", "true",  # the log is our cache-reuse meter
            # by default a streaming completion ends early (a bare [DONE], no finish
            # reason) as soon as any other request waits for the model lock - and GET
            # /v1/models, the health check, takes that lock. Queue them instead.
            "--interrupt_requests", "false",
        ]  # fmt: skip
        if self.cache_bytes > 0:
            argv += ["--cache", "true", "--cache_type", "ram"]
            argv += ["--cache_size", str(self.cache_bytes)]
        return argv

    async def start(self) -> None:
        if not llama_cpp_available():
            raise RuntimeError(
                "llama-cpp-python[server] is not installed in this interpreter; "
                "see docs/real-engine.md for the install commands"
            )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for index in range(self.n):
            port = free_port()
            pod = LlamaPod(port, self.log_dir / f"pod{index}-{port}.log")
            self.pods.append(pod)
            await pod.start(self.server_argv(port))
        await self._wait_ready()

    async def restart(self) -> None:
        """Stop every pod and start it again on the same port: every cache is cold (the
        RAM cache too) and the URLs are unchanged, so routing by URL places prefixes the
        same way as before. Each pod's log starts over."""
        await asyncio.gather(*(pod.stop() for pod in self.pods), return_exceptions=True)
        for pod in self.pods:
            await pod.start(self.server_argv(pod.port))
        await self._wait_ready()

    async def _wait_ready(self) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(p.wait_ready(session, self.startup_timeout) for p in self.pods))

    async def stop(self) -> None:
        await asyncio.gather(*(pod.stop() for pod in self.pods), return_exceptions=True)
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
