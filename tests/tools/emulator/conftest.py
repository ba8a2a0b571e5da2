"""Helpers for the emulator tests: a client session and an SSE parser that acts like one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from prefix_sidecar_tools.emulator import EmulatorConfig

# Fast by default: 1000x faster than real time, still with every stage modelled.
FAST = EmulatorConfig(time_scale=1000.0)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


def parse_sse(raw: str) -> tuple[list[dict[str, Any]], bool]:
    """Events of an SSE body as a client reads them; also whether it ended with [DONE].

    Strict about the framing: every event is exactly one `data: ` line followed by a
    blank line, and [DONE] is last.
    """
    assert raw.endswith("\n\n"), f"stream does not end with a blank line: {raw[-80:]!r}"
    blocks = raw[:-2].split("\n\n")
    events: list[dict[str, Any]] = []
    done = False
    for block in blocks:
        assert not done, "data after [DONE]"
        assert block.startswith("data: ") and "\n" not in block, f"bad SSE event {block!r}"
        payload = block[len("data: ") :]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    return events, done


async def post(
    session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]
) -> tuple[int, Any]:
    async with session.post(url + path, json=body) as response:
        if response.content_type == "text/event-stream":
            return response.status, await response.text()
        return response.status, await response.json()


def prompt_of_tokens(n_tokens: int, seed: str = "rules") -> str:
    """An ASCII prompt of exactly n_tokens tokens (4 bytes each), distinct per seed."""
    unit = (seed * 4)[:4]
    return unit * n_tokens
