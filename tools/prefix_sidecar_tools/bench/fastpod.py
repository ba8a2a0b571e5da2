"""A pod that streams tiny SSE events flat out, and the callers that read them: the load of
issue 11's "a fast pod freezes the sidecar for everyone", for `bench hop` and its test.

Three parts, each its own process so none shares a GIL with the sidecar it loads:
- `python -m prefix_sidecar_tools.bench.fastpod pod`: an HTTP/1.1 server on 127.0.0.1 speaking just
  enough vLLM (`GET /health`, streaming `POST /v1/completions` and `/v1/chat/completions`). Every
  answer is 64 KiB blocks of ~60-byte events, one token "x" each, written as fast as the socket
  takes them (`--per-write 1`: one event per write, as a token-by-token engine does); `--events N`
  ends each answer after N events, 0 never ends it.
- `python -m prefix_sidecar_tools.bench.fastpod callers TARGET`: `--streams` concurrent Complete
  calls through a sidecar for `--seconds`, reading every chunk; prints one JSON line of counts.
- `route_latencies()`: another caller's Route, timed, from the process that calls it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.bench.children import ready_child
from prefix_sidecar_tools.harness import SidecarProcesses, stop_on_signals
from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.report import target_lines

EVENT = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
BLOCK_EVENTS = 64 * 1024 // len(EVENT)
_END = (
    b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    b"data: [DONE]\n\n"
)

MAX_REQUEST_BYTES = 1024 * 1024


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


async def _serve_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, events: int, per_write: int
) -> None:
    block = _chunked(EVENT * per_write)
    try:
        while True:  # keep-alive: one request after another
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path = lines[0].split(" ")[:2]
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = min(int(value), MAX_REQUEST_BYTES)
            await reader.readexactly(length)
            if method == "GET":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
                continue
            if not path.startswith("/v1/"):
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                continue
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            left = events
            while events == 0 or left > 0:
                if events and left < per_write:
                    writer.write(_chunked(EVENT * left))
                    left = 0
                else:
                    writer.write(block)
                    left -= per_write
                await writer.drain()
            writer.write(_chunked(_END) + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass  # the sidecar went away (a cancelled caller closes its pod connection)
    finally:
        writer.close()


async def _serve_pod(events: int, per_write: int) -> None:
    server = await asyncio.start_server(
        lambda r, w: _serve_connection(r, w, events, per_write), "127.0.0.1", 0
    )
    port = server.sockets[0].getsockname()[1]
    print(f"READY http://127.0.0.1:{port}", flush=True)
    stop = stop_on_signals()
    async with server:
        await stop.wait()


@contextlib.asynccontextmanager
async def child(*args: str, ready: bool = True) -> AsyncIterator[tuple[Any, str]]:
    """Run `python -m prefix_sidecar_tools.bench.fastpod ARGS`; yield (process, its READY
    word or "")."""
    module = "prefix_sidecar_tools.bench.fastpod"
    what = f"fastpod {args[0]}"
    async with ready_child(module, *args, what=what, wait_ready=ready) as (process, words):
        yield process, words[0] if words else ""


def fast_pod(
    events: int = 0, per_write: int = BLOCK_EVENTS
) -> contextlib.AbstractAsyncContextManager[tuple[Any, str]]:
    """`async with fast_pod() as (process, url):` a fast pod process."""
    return child("pod", "--events", str(events), "--per-write", str(per_write))


async def run_callers(target: str, streams: int, seconds: float) -> dict[str, Any]:
    """`streams` Complete calls at a time for `seconds`, each read to its end (or the time)."""
    counts: dict[str, float] = {"chunks": 0, "text_bytes": 0, "calls": 0, "errors": 0}

    async def one(stub: router_pb2_grpc.RouterStub, deadline: float) -> None:
        while (left := deadline - time.monotonic()) > 0:
            call = stub.Complete(router_pb2.CompleteRequest(input="go"), timeout=left + 5)
            try:
                async with asyncio.timeout(left):
                    async for chunk in call:
                        counts["chunks"] += 1
                        counts["text_bytes"] += len(chunk.text)
                counts["calls"] += 1
            except TimeoutError:
                call.cancel()
                return
            except grpc.aio.AioRpcError:
                counts["errors"] += 1

    async with grpc.aio.insecure_channel(target) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        started = time.monotonic()
        await asyncio.gather(*(one(stub, started + seconds) for _ in range(streams)))
        counts["seconds"] = time.monotonic() - started
    return counts


def callers(
    target: str, streams: int, seconds: float
) -> contextlib.AbstractAsyncContextManager[tuple[Any, str]]:
    """`async with callers(...) as (process, _):` then `await read_counts(process)`."""
    return child("callers", target, "--streams", str(streams), "--seconds", str(seconds),
                 ready=False)  # fmt: skip


async def read_counts(process: Any, timeout: float) -> dict[str, Any]:
    out, _ = await asyncio.wait_for(process.communicate(), timeout)
    if process.returncode != 0:
        raise RuntimeError(f"fastpod callers exited {process.returncode}")
    counts: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return counts


async def route_latencies(target: str, seconds: float, every_s: float = 0.01) -> list[float]:
    """Seconds per Route call, one at a time, `every_s` apart, for `seconds`."""
    samples: list[float] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            started = time.perf_counter()
            await stub.Route(router_pb2.RouteRequest(prompt="another caller"), timeout=30)
            samples.append(time.perf_counter() - started)
            await asyncio.sleep(every_s)
    return samples


TARGET_CHUNKS_PER_S = 20_000
TARGET_ROUTE_P50_S = 0.1
TARGET_ROUTE_MAX_S = 1.0


async def measure_stream_load(
    streams: int, seconds: float, settings: dict[str, object] | None = None
) -> dict[str, Any]:
    """A sidecar process in front of a fast pod: what it relays while `streams` callers
    read flat out, and what another caller's Route costs meanwhile (and before)."""
    async with (
        fast_pod() as (_, url),
        SidecarProcesses(1, [url], "prefix_affinity", settings) as sidecars,
    ):
        target = sidecars.targets[0]
        idle = await route_latencies(target, 0.5)
        async with callers(target, streams, seconds) as (process, _):
            settle = min(0.5, seconds / 4)
            await asyncio.sleep(settle)
            busy = await route_latencies(target, max(0.2, seconds - 2 * settle))
            counts = await read_counts(process, seconds + 30)
    chunks_per_s = counts["text_bytes"] / counts["seconds"]  # one token "x" per pod chunk
    p50, worst = percentile(busy, 50), max(busy)
    return {
        "streams": streams,
        "seconds": counts["seconds"],
        "pod_chunks_per_s": chunks_per_s,
        "grpc_messages_per_s": counts["chunks"] / counts["seconds"],
        "errors": counts["errors"],
        "route_idle_p50_ms": percentile(idle, 50) * 1e3,
        "route_busy_p50_ms": p50 * 1e3,
        "route_busy_max_ms": worst * 1e3,
        "route_busy_n": len(busy),
        "targets": [
            {
                "name": f"pod chunks relayed per sidecar process >= {TARGET_CHUNKS_PER_S:,}/s",
                "measured": f"{chunks_per_s:,.0f}/s",
                "met": chunks_per_s >= TARGET_CHUNKS_PER_S,
            },
            {
                "name": f"another caller's Route under {streams} fast streams: p50 <= "
                f"{TARGET_ROUTE_P50_S * 1e3:.0f} ms, max <= {TARGET_ROUTE_MAX_S:g} s",
                "measured": f"p50 {p50 * 1e3:.1f} ms, max {worst * 1e3:.1f} ms",
                "met": p50 <= TARGET_ROUTE_P50_S and worst <= TARGET_ROUTE_MAX_S,
            },
        ],
    }


def render_stream_load(report: dict[str, Any]) -> list[str]:
    lines = [
        f"fast stream: {report['streams']} callers reading a pod that streams tiny events "
        f"flat out, {report['seconds']:.1f} s",
        f"  relayed {report['pod_chunks_per_s']:,.0f} pod chunks/s in "
        f"{report['grpc_messages_per_s']:,.0f} gRPC messages/s, {report['errors']} errors",
        f"  another caller's Route: p50 {report['route_busy_p50_ms']:.1f} ms, max "
        f"{report['route_busy_max_ms']:.1f} ms (idle p50 {report['route_idle_p50_ms']:.1f} ms)",
    ]
    return lines + target_lines(report["targets"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefix_sidecar_tools.bench.fastpod")
    sub = parser.add_subparsers(dest="command", required=True)
    pod = sub.add_parser("pod")
    pod.add_argument("--events", type=int, default=0, help="events per answer (0: endless)")
    pod.add_argument("--per-write", type=int, default=BLOCK_EVENTS, help="events per write")
    load = sub.add_parser("callers")
    load.add_argument("target")
    load.add_argument("--streams", type=int, default=8)
    load.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    if args.command == "pod":
        asyncio.run(_serve_pod(args.events, max(1, args.per_write)))
    else:
        counts = asyncio.run(run_callers(args.target, args.streams, args.seconds))
        print(json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
