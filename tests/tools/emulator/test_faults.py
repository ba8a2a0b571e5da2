"""Every fault switch, set at run time through /admin/faults (and reset-cache)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from prefix_sidecar_tools.emulator import (
    EmulatorConfig,
    get_stats,
    reset_cache,
    run_emulator,
    set_faults,
)

from .conftest import FAST, parse_sse, post, prompt_of_tokens

STREAM = {"prompt": "script for a live stream", "max_tokens": 8, "stream": True}


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_fail_next_n(session: aiohttp.ClientSession, status: int) -> None:
    async with run_emulator(FAST) as url:
        faults = await set_faults(url, fail_next=2, fail_status=status)
        assert faults["fail_next"] == 2
        results = [await post(session, url, "/v1/completions", {"prompt": "x"}) for _ in range(3)]
        assert [code for code, _ in results] == [status, status, 200]
        error = results[0][1]
        assert error["error"]["code"] == status
        async with session.get(url + "/admin/faults") as response:
            assert (await response.json())["fail_next"] == 0


async def test_stall_delays_first_byte(session: aiohttp.ClientSession) -> None:
    async with run_emulator(FAST) as url:
        await set_faults(url, stall_seconds=0.3)
        start = time.perf_counter()
        status, _ = await post(session, url, "/v1/completions", {"prompt": "x"})
        stalled = time.perf_counter() - start
        await set_faults(url, stall_seconds=0)
        start = time.perf_counter()
        await post(session, url, "/v1/completions", {"prompt": "x"})
        normal = time.perf_counter() - start
    assert status == 200 and stalled >= 0.3 and normal < 0.2


async def test_drop_after_chunks_breaks_the_stream(session: aiohttp.ClientSession) -> None:
    async with run_emulator(FAST) as url:
        await set_faults(url, drop_after_chunks=3)
        received = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.post(url + "/v1/completions", json=STREAM) as response:
                assert response.status == 200
                async for data in response.content.iter_any():
                    received += data
        assert received.count(b"data: ") == 3 and b"[DONE]" not in received
        await set_faults(url, drop_after_chunks=None)
        _, raw = await post(session, url, "/v1/completions", STREAM)
        assert parse_sse(raw)[1]  # healthy streams end with [DONE] again
        assert (await get_stats(url))["aborted"] == 0  # the dropped one still finished


async def test_malformed_event(session: aiohttp.ClientSession) -> None:
    async with run_emulator(FAST) as url:
        await set_faults(url, malformed_after_chunks=1)
        _, raw = await post(session, url, "/v1/completions", STREAM)
    blocks = raw.strip().split("\n\n")
    assert blocks[-1] == "data: [DONE]"
    json.loads(blocks[0][len("data: ") :])
    with pytest.raises(json.JSONDecodeError):
        json.loads(blocks[1][len("data: ") :])
    for block in blocks[2:-1]:
        json.loads(block[len("data: ") :])


async def test_unhealthy_switch(session: aiohttp.ClientSession) -> None:
    async with run_emulator(FAST) as url:
        await set_faults(url, unhealthy=True)
        async with session.get(url + "/health") as response:
            assert response.status == 503
        await set_faults(url, unhealthy=False)
        async with session.get(url + "/health") as response:
            assert response.status == 200


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"explode": True}, "unknown fault 'explode'"),
        ({"fail_status": 404}, "fail_status must be one of"),
        ({"fail_next": "3"}, "fail_next must be an integer"),
        ({"unhealthy": 1}, "unhealthy must be true or false"),
    ],
)
async def test_bad_fault_settings_are_refused(change: dict[str, object], message: str) -> None:
    async with run_emulator(FAST) as url:
        with pytest.raises(ValueError, match=message):
            await set_faults(url, **change)


async def test_reset_cache(session: aiohttp.ClientSession) -> None:
    body = {"prompt": prompt_of_tokens(100), "max_tokens": 1}
    async with run_emulator(FAST) as url:
        await post(session, url, "/v1/completions", body)
        _, warm = await post(session, url, "/v1/completions", body)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        assert await reset_cache(url) == 6
        _, cold = await post(session, url, "/v1/completions", body)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_client_going_away_frees_slot_and_blocks(session: aiohttp.ClientSession) -> None:
    config = EmulatorConfig(model="m", decode_tps=10.0, time_scale=10.0)
    async with run_emulator(config) as url:
        body = {"prompt": prompt_of_tokens(160), "max_tokens": 100, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as response:
            await response.content.readuntil(b"\n\n")
            stats = await get_stats(url)
            assert stats["running"] == 1 and stats["cache"]["pinned_blocks"] == 10
            response.close()  # hang up mid-stream
        for _ in range(100):
            stats = await get_stats(url)
            if stats["running"] == 0:
                break
            await asyncio.sleep(0.02)
    assert stats["running"] == 0 and stats["aborted"] == 1
    assert stats["cache"]["pinned_blocks"] == 0 and stats["cache"]["cached_blocks"] == 10
