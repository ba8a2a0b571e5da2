"""Replay a trace through one or more sidecars over gRPC, open loop, timing every request.

Open loop: each request is sent at its scheduled time whether or not earlier ones have
answered, and its TTFT is measured from that scheduled time, so a saturated fleet shows
up as queueing delay instead of being hidden by a slower sender (coordinated omission).
With K sidecars, request i goes to sidecar i mod K, as K callers would share the traffic.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.workload.trace import Arrival

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
]


@dataclass(kw_only=True)
class StreamRecord:
    """What read_stream fills in about one request: where it went, its times and tokens, or
    why it failed. The benches' records (Outcome here, the organic bench's Result) add what
    they sent; these fields are keywords, after theirs."""

    # Real seconds: since the run started; from the send (for Outcome, the scheduled one,
    # so a saturated fleet shows its queueing) to the first and to the last chunk.
    sent_at: float = math.nan
    backend: str = ""
    ttft_s: float = math.nan
    total_s: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class Outcome(StreamRecord):
    """One request of the fleet bench's trace: its prefix and the sidecar it went through."""

    seq: int
    prefix: int
    sidecar: int


TIMEOUT = "TTFT_TIMEOUT"  # no first token within the caller's patience

RequestFactory = Callable[[Arrival], router_pb2.CompleteRequest]


def thin_requests(prefix_ids: Sequence[str], max_tokens: int) -> RequestFactory:
    """The sidecar's way: the registered prefix's id plus the thin query."""

    def make(arrival: Arrival) -> router_pb2.CompleteRequest:
        return router_pb2.CompleteRequest(
            prefix_id=prefix_ids[arrival.prefix],
            input=arrival.input,
            max_tokens=max_tokens,
            temperature=0.0,
        )

    return make


async def _one(
    stub: router_pb2_grpc.RouterStub,
    request: router_pb2.CompleteRequest,
    outcome: Outcome,
    scheduled: float,
    first_token_timeout_s: float,
) -> None:
    """Stream one request; a caller that waits longer than `first_token_timeout_s` for the
    first token gives up and hangs up (as a merchant's client would)."""
    call = stub.Complete(request)
    first_s = max(0.001, first_token_timeout_s - (time.perf_counter() - scheduled))
    await read_stream(call, outcome, scheduled, first_s)


async def read_stream(
    call: Any, record: StreamRecord, started: float, first_token_timeout_s: float
) -> None:
    """Read a Complete/Chat stream to its end into `record`, times from `started`; a caller
    that waits longer than `first_token_timeout_s` for the first chunk hangs up."""
    try:
        chunk = await asyncio.wait_for(call.read(), first_token_timeout_s)
        while chunk is not grpc.aio.EOF:
            assert isinstance(chunk, router_pb2.Chunk)
            if math.isnan(record.ttft_s):
                record.ttft_s = time.perf_counter() - started
            if chunk.backend:
                record.backend = chunk.backend
            if chunk.HasField("usage"):
                record.prompt_tokens = chunk.usage.prompt_tokens
                record.cached_tokens = chunk.usage.cached_tokens
                record.completion_tokens = chunk.usage.completion_tokens
            chunk = await call.read()
        record.total_s = time.perf_counter() - started
    except TimeoutError:
        call.cancel()
        record.error = TIMEOUT
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"


async def drive(
    targets: Sequence[str],
    trace: Sequence[Arrival],
    make_request: RequestFactory,
    *,
    time_scale: float,
    first_token_timeout_s: float = 60.0,
    progress: Callable[[int, int], None] | None = None,
) -> list[Outcome]:
    """Send every arrival at `arrival.at / time_scale` real seconds after the start;
    `first_token_timeout_s` is in real seconds."""
    if not targets:
        raise ValueError("drive needs at least one sidecar target")
    channels = [grpc.aio.insecure_channel(t, options=CHANNEL_OPTIONS) for t in targets]
    try:
        for channel in channels:
            await asyncio.wait_for(channel.channel_ready(), 10.0)
        stubs = [router_pb2_grpc.RouterStub(channel) for channel in channels]
        outcomes = [Outcome(a.seq, a.prefix, i % len(targets)) for i, a in enumerate(trace)]
        tasks = []
        start = time.perf_counter()
        for arrival, outcome in zip(trace, outcomes, strict=True):
            scheduled = start + arrival.at / time_scale
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome.sent_at = scheduled - start
            request = make_request(arrival)
            tasks.append(
                asyncio.create_task(
                    _one(stubs[outcome.sidecar], request, outcome, scheduled, first_token_timeout_s)
                )
            )
            if progress is not None:
                progress(len(tasks), len(trace))
        await asyncio.gather(*tasks)
        return outcomes
    finally:
        for channel in channels:
            await channel.close()
