"""A fleet of emulated pods, one OS process each, for fault tests, the demo and benches.

Each child is `python -m prefix_sidecar_tools.emulator --port P --exit-on-stdin-eof ...`; it reports
`READY <url>` on stdout, and exits by itself if this process dies (we hold its stdin).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from typing import Any

import aiohttp

from prefix_sidecar.lifecycle import AsyncService
from prefix_sidecar_tools.emulator.config import EmulatorConfig, config_to_argv
from prefix_sidecar_tools.harness import python_command, spawn, spawn_blocking, terminate


class EmulatorFleet(AsyncService):
    """`async with EmulatorFleet(n, config, base_port=0) as fleet:` then `fleet.urls`.

    base_port 0 lets every child pick a free port; a restarted child keeps its port.
    """

    def __init__(
        self,
        n: int,
        config: EmulatorConfig | None = None,
        base_port: int = 0,
        host: str = "127.0.0.1",
        start_timeout: float = 30.0,
    ) -> None:
        if n < 1:
            raise ValueError("a fleet needs at least one pod")
        if base_port and not 0 < base_port <= 65536 - n:
            raise ValueError(f"ports {base_port}..{base_port + n - 1} are not all valid")
        self.config = config or EmulatorConfig()
        self.config.validate()
        self.host = host
        self.start_timeout = start_timeout
        self.ports = [base_port + i if base_port else 0 for i in range(n)]
        self.urls: list[str] = [""] * n
        self.processes: list[asyncio.subprocess.Process | None] = [None] * n

    def __len__(self) -> int:
        return len(self.urls)

    async def start(self) -> None:
        await asyncio.gather(*(self._spawn(i) for i in range(len(self))))

    async def _spawn(self, i: int) -> None:
        argv = python_command(
            "-m",
            "prefix_sidecar_tools.emulator",
            "--host",
            self.host,
            "--port",
            str(self.ports[i]),
            "--exit-on-stdin-eof",
            *config_to_argv(self.config),
        )
        proc = await spawn(argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self.processes[i] = proc
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), self.start_timeout)
        except TimeoutError:
            raise RuntimeError(f"emulator pod {i} did not start in {self.start_timeout}s") from None
        if not line.startswith(b"READY "):
            code = await proc.wait()
            raise RuntimeError(
                f"emulator pod {i} (port {self.ports[i]}) exited with code {code} "
                "before it was ready; its stderr says why"
            )
        url = line.split()[1].decode()
        self.urls[i] = url
        self.ports[i] = int(url.rsplit(":", 1)[1])
        await self._wait_answering(url)

    async def _wait_answering(self, url: str) -> None:
        """Wait until /health answers at all (503 counts: the pod may start unhealthy)."""
        deadline = asyncio.get_running_loop().time() + self.start_timeout
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(f"{url}/health"):
                        return
                except aiohttp.ClientError:
                    if asyncio.get_running_loop().time() > deadline:
                        raise RuntimeError(f"{url} never answered /health") from None
                    await asyncio.sleep(0.05)

    def alive(self, i: int) -> bool:
        proc = self.processes[i]
        return proc is not None and proc.returncode is None

    def kill(self, i: int) -> asyncio.Task[int]:
        """SIGKILL pod i now; the returned task (await it or not) ends when it is reaped."""
        proc = self.processes[i]
        if proc is None:
            raise RuntimeError(f"pod {i} was never started")
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        return asyncio.ensure_future(proc.wait())

    async def restart(self, i: int) -> str:
        """(Kill if alive, then) start pod i again on the same port; returns its URL."""
        if self.processes[i] is not None:
            await self.kill(i)
            self._close_stdin(i)
        await self._spawn(i)
        return self.urls[i]

    def _close_stdin(self, i: int) -> None:
        proc = self.processes[i]
        if proc is not None and proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()

    async def stop(self, grace: float = 3.0) -> None:
        """SIGTERM every pod, SIGKILL what is left after `grace` seconds; reap all."""
        for i in range(len(self.processes)):
            self._close_stdin(i)
        await asyncio.gather(*(terminate(p, grace) for p in self.processes if p is not None))


async def _admin(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, f"{url}{path}", json=body) as response,
    ):
        payload = await response.json()
        if response.status != 200:
            error = payload.get("error") if isinstance(payload, dict) else None
            words = error.get("message", error) if isinstance(error, dict) else payload
            raise ValueError(f"{method} {url}{path}: {words}")
        return payload


async def set_faults(url: str, **faults: Any) -> dict[str, Any]:
    """Change a pod's fault switches at run time; returns all of them after the change."""
    result: dict[str, Any] = await _admin(url, "POST", "/admin/faults", faults)
    return result


async def get_stats(url: str) -> dict[str, Any]:
    """A pod's counters and recent prefills (GET /admin/stats)."""
    result: dict[str, Any] = await _admin(url, "GET", "/admin/stats")
    return result


async def reset_cache(url: str) -> int:
    """Drop a pod's unpinned prefix-cache blocks; returns how many were dropped."""
    result: dict[str, Any] = await _admin(url, "POST", "/admin/reset-cache")
    return int(result["dropped_blocks"])


def start_emulator_blocking(processes: list[subprocess.Popen[Any]], *flags: str) -> str:
    """One emulated pod on a free port for a synchronous harness (the fuzzer, the attack
    runner): its process is appended to `processes` at once, so the caller stops it even if
    it never starts; returns its URL once it has printed READY."""
    pod = spawn_blocking(
        python_command("-m", "prefix_sidecar_tools.emulator", "--port", "0",
                       "--exit-on-stdin-eof", *flags),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    processes.append(pod)
    assert pod.stdout is not None
    line = pod.stdout.readline().decode().split()
    if len(line) != 2 or line[0] != "READY":
        raise RuntimeError(f"the emulator did not start (said {line!r})")
    return line[1]
