"""Run K real sidecar processes (`prefix-sidecar serve`) in front of a fleet, for benchmarks.

Processes, not coroutines in the bench's own loop: the load generator must not share an
interpreter (and a GIL) with the router it measures, and K sidecars sharing traffic are K
processes in production. Each child gets its own unix socket in a private temp dir; ready
means every backend is `serving` in ListBackends, so no request hits a half-started pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

import grpc

from sidecar.lifecycle import AsyncService
from sidecar.tools import PACKAGE_ROOT as _PACKAGE_ROOT
from sidecar.v1 import router_pb2, router_pb2_grpc


class SidecarProcesses(AsyncService):
    """`async with SidecarProcesses(k, backends, policy) as sidecars:` then `sidecars.targets`."""

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
        self.processes: list[asyncio.subprocess.Process] = []
        self.targets: list[str] = []
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    async def start(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="prefix-sidecar-bench-")
        for i in range(self.count):
            await self._spawn(i)
        await asyncio.gather(*(self._wait_ready(i) for i in range(self.count)))

    async def _spawn(self, i: int) -> None:
        assert self._dir is not None
        target = f"unix://{self._dir.name}/sidecar-{i}.sock"
        argv = [sys.executable, "-m", "sidecar.cli", "serve", "--listen", target]
        for url in self.backends:
            argv += ["--backend", url]
        for name, value in {"policy": self.policy, **self.settings}.items():
            argv += ["--set", f"{name}={value}"]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        if self.stderr_path:
            with open(self.stderr_path, "ab") as log:
                process = await asyncio.create_subprocess_exec(
                    *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stderr=log
                )
        else:
            process = await asyncio.create_subprocess_exec(
                *argv, env=env, stdin=asyncio.subprocess.DEVNULL
            )
        self.processes.append(process)
        self.targets.append(target)

    async def _wait_ready(self, i: int) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        last = "not started"
        async with grpc.aio.insecure_channel(self.targets[i]) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            while time.monotonic() < deadline:
                if self.processes[i].returncode is not None:
                    raise RuntimeError(
                        f"sidecar {i} exited with code {self.processes[i].returncode} while "
                        f"starting; its log ({self.stderr_path or 'stderr'}) says why"
                    )
                try:
                    reply = await stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=1.0)
                    states = {b.url: b.state for b in reply.backends}
                    if len(states) == len(self.backends) and set(states.values()) == {"serving"}:
                        return
                    last = f"backends {states}"
                except grpc.aio.AioRpcError as exc:
                    last = exc.code().name
                await asyncio.sleep(0.1)
        raise RuntimeError(
            f"sidecar {i} not ready after {self.start_timeout_s:.0f} s (last: {last})"
        )

    async def stop(self, grace_s: float = 5.0) -> None:
        for process in self.processes:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        self.processes.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
