"""SGLang's router (PyPI `sglang-router`) in front of real vLLM pods: the central
cache-aware router the sidecar is measured against.

    async with SglangRouter(fleet.urls, policy="cache_aware") as router:
        router.url        # http://127.0.0.1:PORT: /v1/completions, proxied to a pod

Why a process of its own: the router is a Rust binary behind a Python launcher
(`python -m sglang_router.launch_router`), run as its users run it. Every address it binds
is loopback (`--host`, and `--prometheus-host`, which would otherwise listen on 0.0.0.0),
and it only knows the pods' 127.0.0.1 URLs. It checks the workers' /health once a second
while it starts (the default is every 30 s), so it is ready a second after the pods are.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from prefix_sidecar.lifecycle import AsyncService
from prefix_sidecar_tools.harness import child_env, free_port, spawn, terminate_group

LAUNCHER = ("-m", "sglang_router.launch_router")
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


def sglang_router_available() -> bool:
    """True when `python -m sglang_router.launch_router` can run in this interpreter."""
    return importlib.util.find_spec("sglang_router") is not None


class SglangRouter(AsyncService):
    """One SGLang router process on 127.0.0.1 over `worker_urls`, its log in a temp file."""

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        policy: str = "cache_aware",
        start_timeout: float = 60.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: SGLang's router knows {', '.join(POLICIES)}")
        if not all(url.startswith("http://127.0.0.1:") for url in worker_urls):
            raise ValueError(f"the router may only reach loopback pods, got {list(worker_urls)}")
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.start_timeout = start_timeout
        self.extra_args = list(extra_args)
        self.port = 0
        self._folder = Path(tempfile.mkdtemp(prefix="sglang-"))
        self.log_path = self._folder / "router.log"
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [
            sys.executable, *LAUNCHER,
            "--worker-urls", *self.worker_urls,
            "--policy", self.policy,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1",
            "--log-level", "warn",
            *self.extra_args,
        ]  # fmt: skip

    async def start(self) -> None:
        self.port = free_port()
        with self.log_path.open("ab") as log:
            self.process = await spawn(
                self.argv(),
                env=child_env(),
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop()
            raise

    async def _wait_ready(self) -> None:
        """Until GET /readiness answers 200 (its /health does as soon as it listens, before
        any pod is registered, and requests then get 503 no_available_workers) and every
        pod is listed by GET /workers; fail early if it exits."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while loop.time() < deadline:
                if self.process is not None and self.process.returncode is not None:
                    raise RuntimeError(f"SGLang's router exited:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, ValueError):
                    if await self._ready(session):
                        return
                await asyncio.sleep(0.25)
        raise TimeoutError(
            f"SGLang's router was not ready within {self.start_timeout:.0f} s:\n{self.log_tail()}"
        )

    async def _ready(self, session: aiohttp.ClientSession) -> bool:
        async with session.get(f"{self.url}/readiness") as response:
            if response.status != 200:
                return False
        async with session.get(f"{self.url}/workers") as response:
            listed = (await response.json()).get("workers") or []
        return len(listed) >= len(self.worker_urls)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text("utf-8", errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    async def stop(self) -> None:
        if self.process is not None:
            await terminate_group(self.process, 10.0)
            self.process = None
        shutil.rmtree(self._folder, ignore_errors=True)
