"""A real redis-server on 127.0.0.1 per test (Debian's; .ci/run installs it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from prefix_sidecar_tools.redis_server import RedisServer


@pytest.fixture
async def redis_server(tmp_path: Path) -> AsyncIterator[RedisServer]:
    server = RedisServer(tmp_path)
    await server.start()
    try:
        yield server
    finally:
        if server.process is not None:
            server.pause(False)
        server.kill()


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url, socket_timeout=2)
    yield client
    await client.aclose()
