"""A throwaway redis-server on 127.0.0.1 (Debian's `redis-server`), no persistence, that a
caller may pause (SIGSTOP), kill and start again on its port: the shared block index's
tests and `bench kv-index`."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from redis.asyncio import Redis

from prefix_sidecar.kv_index import layout
from prefix_sidecar_tools.harness import free_port

START_TIMEOUT_S = 10.0
INDEXED_TIMEOUT_S = 30.0


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install redis-server")
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
        )
        client = Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + START_TIMEOUT_S
            while True:
                with contextlib.suppress(Exception):
                    if await client.ping():
                        return
                assert loop.time() < deadline, f"redis-server not up on {self.port}"
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(5)
            self.process = None

    def pause(self, paused: bool) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)


@contextlib.asynccontextmanager
async def indexer_process(backends: list[str], redis_url: str) -> AsyncIterator[None]:
    """`prefix-sidecar kv-indexer` over `backends` into `redis_url`, as a process, stopped
    by SIGTERM when the block ends."""
    command = [sys.executable, "-m", "prefix_sidecar.cli", "kv-indexer", "--redis", redis_url]
    command += [f"--backend={url}" for url in backends]
    process = await asyncio.create_subprocess_exec(*command)
    try:
        yield
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 10)


@contextlib.asynccontextmanager
async def shared_index(backends: list[str]) -> AsyncIterator[str]:
    """A throwaway redis-server and an indexer over `backends`; yields the Redis URL."""
    with tempfile.TemporaryDirectory() as workdir:
        server = RedisServer(Path(workdir))
        await server.start()
        try:
            async with indexer_process(backends, server.url):
                await indexed(server.url, len(backends))
                yield server.url
        finally:
            server.kill()


async def indexed(url: str, pods: int) -> None:
    """Until the indexer has written its first pass (each pod's generation, once it has
    read their history), as the sidecars of a fleet whose indexer has been running find it."""
    client = Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        async with asyncio.timeout(INDEXED_TIMEOUT_S):
            while await client.hlen(layout.pods_name(layout.DEFAULT_NAMESPACE)) < pods:
                await asyncio.sleep(0.05)
    finally:
        await client.aclose()
