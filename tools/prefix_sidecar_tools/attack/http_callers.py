"""Hostile callers of the HTTP front (issue 27's defects 2, 3, 4 and 7), the way an outside
probe found them. Each takes the front's HOST:PORT (`http` in the options), is bounded by a
count and a deadline, reads what the server answers, and reports what it saw: the statuses
(`errors`, as "HTTP 400", ...), the bytes it put on the wire and how long the server took.

- large_body: a body at the size limit whose shape makes json.loads slow: `shape` "tokens"
  (a prompt of token ids, ~2 bytes each) or "messages" (a chat of tiny messages). Before the
  fix one such body held the event loop 0.84-1.0 s (tokens) or ~0.3 s (messages).
- tiny_chunks: a chunked body in `chunk`-byte chunks (2: 7 wire bytes carry 2 of data), sent
  until the server answers. Before: ~520 MB of the sidecar's memory for 7.5 MiB of data.
- many_connections: `connections` idle connections held `hold_s`; how many the server
  answered 503 and closed at once (the cap) and how many could not be opened.
- deep_json: a body nesting `depth` arrays (3,000 levels is 6 KB), `count` times. Before:
  a 500 and a 30-line ERROR traceback each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

from prefix_sidecar_tools.attack.abuse import AbuseResult, fd_limit_room

LIMIT = 8 * 1024 * 1024  # max_message_bytes' default
OPEN_DEADLINE_S = 30.0  # many_connections stops opening after this, or MAX_FAILURES in a row
MAX_FAILURES = 20


def _address(http: str) -> tuple[str, int]:
    host, _, port = http.removeprefix("http://").rstrip("/").rpartition(":")
    return host, int(port)


def large_request(shape: str, size: int) -> tuple[str, bytes]:
    """(path, body): a body of at most `size` bytes of the given shape."""
    rng = random.Random(0)
    if shape == "tokens":
        count = (size - 64) // 2
        ids = b",".join(b"%d" % rng.randrange(10) for _ in range(count))
        return "/v1/completions", b'{"max_tokens":1,"prompt":[' + ids + b"]}"
    message = b'{"role":"user","content":"h"},'
    count = (size - 64) // len(message)
    body = b'{"max_tokens":1,"messages":[' + message * count
    return "/v1/chat/completions", body[:-1] + b"]}"


async def _exchange(http: str, request: bytes, result: AbuseResult) -> bytes:
    """Send a request on a new connection; the answer's head (or what came)."""
    reader, writer = await asyncio.open_connection(*_address(http))
    result.connections += 1
    try:
        writer.write(request)
        await writer.drain()
        result.bytes_sent += len(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        with contextlib.suppress(asyncio.IncompleteReadError):
            await reader.readexactly(length)
        return head
    finally:
        writer.close()


def _status(head: bytes) -> str:
    parts = head.split(b" ", 2)
    return f"HTTP {parts[1].decode()}" if len(parts) > 1 else "no answer"


async def large_body(
    http: str, shape: str = "tokens", size: int = LIMIT, count: int = 3
) -> AbuseResult:
    result = AbuseResult(f"large_body_{shape}")
    path, body = large_request(shape, size)
    request = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % path.encode()
    request += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    started = time.monotonic()
    for _ in range(count):
        try:
            result.errors.append(_status(await _exchange(http, request, result)))
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            result.errors.append(type(exc).__name__)
        result.streams += 1
    result.seconds = time.monotonic() - started
    return result


async def tiny_chunks(
    http: str, chunk: int = 2, data_bytes: int = 7 * 1024 * 1024 + 512 * 1024
) -> AbuseResult:
    result = AbuseResult(f"tiny_chunks_{chunk}")
    reader, writer = await asyncio.open_connection(*_address(http))
    result.connections = 1
    started = time.monotonic()
    piece = b"%x\r\n%s\r\n" % (chunk, b"a" * chunk)
    block = piece * max(1, 65536 // len(piece))
    answer = asyncio.create_task(reader.readuntil(b"\r\n\r\n"))
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        sent = 0
        with contextlib.suppress(ConnectionError):
            while sent < data_bytes and not answer.done():
                writer.write(block)
                await writer.drain()
                sent += chunk * (len(block) // len(piece))
                result.bytes_sent += len(block)
                if time.monotonic() - started > 120:
                    result.errors.append("deadline")
                    break
            if not answer.done():
                writer.write(b"0\r\n\r\n")
        try:
            result.errors.append(_status(await asyncio.wait_for(answer, 60)))
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            result.errors.append(type(exc).__name__)
    finally:
        answer.cancel()
        writer.close()
    result.seconds = time.monotonic() - started
    return result


async def many_connections(http: str, connections: int = 5000, hold_s: float = 5.0) -> AbuseResult:
    result = AbuseResult("many_connections")
    started = time.monotonic()
    opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        failures = 0  # in a row: a server that accepts nothing fills its backlog, then
        for _ in range(fd_limit_room(connections)):  # every connect times out
            if failures >= MAX_FAILURES or time.monotonic() - started > OPEN_DEADLINE_S:
                result.errors.append("gave up opening")
                break
            try:
                opened.append(await asyncio.wait_for(asyncio.open_connection(*_address(http)), 1))
                failures = 0
            except (OSError, TimeoutError) as exc:
                result.errors.append(type(exc).__name__)
                failures += 1
        result.connections = len(opened)
        await asyncio.sleep(hold_s)
        for reader, _writer in opened:
            if reader.at_eof() or reader._buffer:  # type: ignore[attr-defined]  # answered
                result.closed_by_server += 1
                if bytes(reader._buffer).startswith(b"HTTP/1.1 503 "):  # type: ignore[attr-defined]
                    result.refused_streams += 1
    finally:
        for _reader, writer in opened:
            writer.close()
    result.seconds = time.monotonic() - started
    return result


async def deep_json(http: str, depth: int = 3000, count: int = 20) -> AbuseResult:
    result = AbuseResult("deep_json")
    nested = b'{"prompt":"p","x":' + b"[" * depth + b"]" * depth + b"}"
    started = time.monotonic()
    for i in range(count):
        path = b"/v1/completions" if i % 2 == 0 else b"/v1/chat/completions"
        request = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
            path, len(nested), nested
        )  # fmt: skip
        try:
            result.errors.append(_status(await _exchange(http, request, result)))
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            result.errors.append(type(exc).__name__)
    result.seconds = time.monotonic() - started
    return result


ATTACKS: dict[str, Callable[..., Coroutine[Any, Any, AbuseResult]]] = {
    "large_body": large_body,
    "tiny_chunks": tiny_chunks,
    "many_connections": many_connections,
    "deep_json": deep_json,
}


def summary(result: AbuseResult) -> dict[str, Any]:
    """AbuseResult.summary() with every status, counted."""
    counted: dict[str, int] = {}
    for status in result.errors:
        counted[status] = counted.get(status, 0) + 1
    return {**result.summary(), "statuses": counted}


if __name__ == "__main__":
    import sys

    name, options = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(summary(asyncio.run(ATTACKS[name](**options)))), flush=True)
