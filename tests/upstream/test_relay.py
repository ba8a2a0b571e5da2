"""Relay, unit by unit, against real aiohttp pods on 127.0.0.1: failover before the first
token, a partial stream after it, the caller's request errors, deadlines, chunk splitting,
and the bookkeeping (in-flight counts, health reports, trace headers) every attempt does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import pytest
from aiohttp import web

from prefix_sidecar.abort import RpcAbort
from prefix_sidecar.membership.health import HealthMonitor
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.membership.sources import Member
from prefix_sidecar.metrics import FRONT_GRPC, Metrics
from prefix_sidecar.upstream.chunks import split_utf8
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.delta_exchange import TRUNCATED, DeltaExchange
from prefix_sidecar.upstream.outcome import RelayOutcome
from prefix_sidecar.upstream.relay import Relay, RelayPolicy
from prefix_sidecar.v1 import router_pb2
from tests.fake_pod import respond, start_site

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def text_event(text: str, finish_reason: str | None = None) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]})


USAGE = event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
DONE = b"data: [DONE]\n\n"


def streams(*parts: bytes, cut: bool = False, stall_s: float = 0.0) -> Handler:
    """A 200 answer writing `parts` (after `stall_s`), then ending the body, or dropping the
    connection if `cut` (a moment later, to let the first token reach the relay first)."""
    return respond(*parts, cut=cut, stall_s=stall_s, cut_after_s=0.05)


def answers(status: int, message: str = "nope") -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": message}}, status=status)

    return handle


OK = streams(text_event("hello "), text_event("world", "stop"), USAGE, DONE)


@dataclass
class Pod:
    url: str = ""
    handler: Handler = OK
    headers: list[dict[str, str]] = field(default_factory=list)


@dataclass
class Health:
    """Records what the relay reports about pods (HealthMonitor's two request-path hooks)."""

    failures: list[str] = field(default_factory=list)
    successes: list[str] = field(default_factory=list)

    def record_failure(self, url: str, error: str) -> None:
        self.failures.append(url)

    def record_success(self, url: str) -> None:
        self.successes.append(url)


@pytest.fixture
async def start_pod() -> AsyncIterator[Callable[[Handler], Awaitable[Pod]]]:
    runners: list[web.AppRunner] = []

    async def start(handler: Handler = OK) -> Pod:
        pod = Pod(handler=handler)

        async def inference(request: web.Request) -> web.StreamResponse:
            pod.headers.append(dict(request.headers))
            await request.read()
            return await pod.handler(request)

        app = web.Application()
        app.router.add_post("/v1/completions", inference)
        runner, pod.url = await start_site(app, access_log=None, shutdown_timeout=0.5)
        runners.append(runner)
        return pod

    yield start
    for runner in runners:
        await asyncio.wait_for(runner.cleanup(), 5)


@dataclass
class Rig:
    relay: Relay
    pool: BackendPool
    metrics: Metrics
    health: Health


@pytest.fixture
async def rig() -> AsyncIterator[Callable[..., Rig]]:
    clients: list[UpstreamClient] = []

    def build(urls: list[str], **policy: Any) -> Rig:
        client = UpstreamClient(connect_timeout_s=1.0)
        clients.append(client)
        pool = BackendPool()
        pool.set_members([Member(url) for url in urls])
        metrics = Metrics()
        health = Health()
        settings: dict[str, Any] = {
            "max_attempts": 3,
            "first_token_timeout_s": 2.0,
            "upstream_timeout_s": 10.0,
        }
        settings.update(policy)
        relay = Relay(client, pool, cast(HealthMonitor, health), metrics, RelayPolicy(**settings))
        return Rig(relay, pool, metrics, health)

    yield build
    for client in clients:
        await client.close()


@dataclass
class Result:
    chunks: list[router_pb2.Chunk]
    outcome: RelayOutcome
    abort: RpcAbort | None
    accepted: int

    @property
    def text(self) -> str:
        return "".join(chunk.text for chunk in self.chunks)


async def relay_once(
    rig: Rig,
    candidates: list[str],
    *,
    time_remaining: Callable[[], float | None] = lambda: None,
    headers: dict[str, str] | None = None,
    forced_first: bool = False,
) -> Result:
    outcome = RelayOutcome()
    chunks: list[router_pb2.Chunk] = []
    accepted: list[int] = []
    abort = None
    try:
        async with asyncio.timeout(20):
            exchange = DeltaExchange(
                rig.relay.client,
                "/v1/completions",
                b'{"prompt":"hi","stream":true}',
                chat=False,
                outcome=outcome,
                max_message_bytes=rig.relay.policy.max_message_bytes,
                on_accepted=lambda: accepted.append(1),
                headers=headers,
                raw_events=False,
            )
            async for chunk in rig.relay.attempts(
                candidates,
                exchange,
                front=FRONT_GRPC,
                outcome=outcome,
                time_remaining=time_remaining,
                forced_first=forced_first,
            ):
                chunks.append(chunk)
    except RpcAbort as exc:
        abort = exc
    return Result(chunks, outcome, abort, len(accepted))


def failovers(metrics: Metrics, backend: str, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "prefix_sidecar_failovers_total", {"front": "grpc", "backend": backend, "reason": reason}
    )
    return value or 0.0


async def test_a_healthy_pod_streams_backend_first_and_usage_last(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig]
) -> None:
    pod = await start_pod(OK)
    r = rig([pod.url])
    result = await relay_once(r, [pod.url])
    assert result.abort is None and result.text == "hello world"
    assert result.chunks[0].backend == pod.url and result.chunks[0].attempts == 1
    assert all(not c.backend for c in result.chunks[1:])
    assert result.chunks[-1].usage.prompt_tokens == 5
    assert result.outcome.status == "OK" and result.outcome.usage == (5, 2, 0)
    assert result.outcome.ttft_s is not None and result.accepted == 1
    assert r.health.successes == [pod.url] and r.pool.backends[pod.url].in_flight == 0


async def test_a_key_s_only_home_is_counted_apart_from_a_failover(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig]
) -> None:
    """The pool counts what the first attempt took as the key's only home apart from
    choices (the fleet view's K-fold term); a failover is a choice."""
    slow = streams(text_event("hi", "stop"), USAGE, DONE, stall_s=0.3)
    home, bad, spare = await start_pod(slow), await start_pod(answers(503)), await start_pod(slow)
    r = rig([home.url, bad.url, spare.url])
    seen: dict[str, tuple[int, int]] = {}

    async def watch(url: str) -> None:
        while r.pool.backends[url].in_flight == 0:
            await asyncio.sleep(0.01)
        seen[url] = (r.pool.backends[url].in_flight, r.pool.backends[url].chosen)

    for candidates in ([home.url], [bad.url, spare.url]):
        watcher = asyncio.create_task(watch(candidates[-1]))
        result = await relay_once(r, candidates, forced_first=True)
        await watcher
        assert result.abort is None and result.text == "hi"
    assert seen == {home.url: (1, 0), spare.url: (1, 1)}
    assert all(b.in_flight == b.chosen == 0 for b in r.pool.backends.values())


@pytest.mark.parametrize("status", [500, 503, 429, 302])
async def test_a_failing_pod_before_the_first_token_moves_to_the_next(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig], status: int
) -> None:
    bad, good = await start_pod(answers(status)), await start_pod(OK)
    r = rig([bad.url, good.url])
    result = await relay_once(r, [bad.url, good.url])
    assert result.abort is None and result.text == "hello world"
    assert result.outcome.backend == good.url and result.outcome.attempts == 2
    assert result.chunks[0].backend == good.url and result.chunks[0].attempts == 2
    assert failovers(r.metrics, bad.url, f"http_{status}") == 1
    assert len(bad.headers) == len(good.headers) == 1
    assert all(b.in_flight == 0 for b in r.pool.backends.values())


async def test_a_refused_connection_moves_on_and_is_reported_to_health(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig], closed_port: int
) -> None:
    dead = f"http://127.0.0.1:{closed_port}"
    good = await start_pod(OK)
    r = rig([dead, good.url])
    result = await relay_once(r, [dead, good.url])
    assert result.abort is None and result.outcome.backend == good.url
    assert failovers(r.metrics, dead, "connection") == 1
    assert r.health.failures == [dead]


@pytest.mark.parametrize(
    "handler",
    [
        streams(text_event("", None), DONE),  # [DONE] without a finish_reason or text
        streams(b"data: {not json\n\n"),  # a malformed stream
        streams(stall_s=5.0),  # no first token in time
    ],
    ids=["truncated", "malformed", "stalled"],
)
async def test_a_broken_stream_before_the_first_token_moves_on(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig], handler: Handler
) -> None:
    bad, good = await start_pod(handler), await start_pod(OK)
    r = rig([bad.url, good.url], first_token_timeout_s=0.5)
    result = await relay_once(r, [bad.url, good.url])
    assert result.abort is None and result.text == "hello world"
    assert result.outcome.attempts == 2 and result.outcome.backend == good.url


async def test_a_stream_broken_after_the_first_token_ends_partial_without_failover(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig]
) -> None:
    broken = await start_pod(streams(text_event("half an "), cut=True))
    other = await start_pod(OK)
    r = rig([broken.url, other.url])
    result = await relay_once(r, [broken.url, other.url])
    assert result.text == "half an ", "the text already sent stands"
    assert result.abort is not None and result.abort.code == grpc.StatusCode.UNAVAILABLE
    assert "after the first token" in result.abort.message
    assert "partial" in result.abort.message
    assert result.outcome.status == "PARTIAL" and result.outcome.attempts == 1
    assert other.headers == [], "replaying elsewhere would duplicate text the caller has"
    assert r.pool.backends[broken.url].in_flight == 0


async def test_a_stream_ending_without_a_finish_reason_after_text_is_partial(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig]
) -> None:
    pod = await start_pod(streams(text_event("cut "), DONE))
    r = rig([pod.url])
    result = await relay_once(r, [pod.url])
    assert result.text == "cut "
    assert result.abort is not None and TRUNCATED in result.abort.message
    assert result.outcome.status == "PARTIAL"


async def test_a_pod_rejecting_the_request_is_invalid_argument_without_failover(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig]
) -> None:
    bad = await start_pod(answers(400, "max_tokens is too large"))
    other = await start_pod(OK)
    r = rig([bad.url, other.url])
    result = await relay_once(r, [bad.url, other.url])
    assert result.abort is not None and result.abort.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens is too large" in result.abort.message
    assert result.outcome.status == "INVALID_ARGUMENT" and other.headers == []


async def test_every_pod_failing_is_unavailable_naming_each_attempt(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig]
) -> None:
    pods = [await start_pod(answers(503, f"busy {n}")) for n in range(3)]
    urls = [pod.url for pod in pods]
    r = rig(urls, max_attempts=2)
    result = await relay_once(r, urls)
    assert result.abort is not None and result.abort.code == grpc.StatusCode.UNAVAILABLE
    assert "after 2 attempt(s)" in result.abort.message
    assert "busy 0" in result.abort.message and "busy 1" in result.abort.message
    assert pods[2].headers == [], "max_attempts bounds the pods tried"
    assert result.outcome.status == "UNAVAILABLE" and result.accepted == 0


async def test_an_expired_deadline_tries_no_pod(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig]
) -> None:
    pod = await start_pod(OK)
    r = rig([pod.url])
    result = await relay_once(r, [pod.url], time_remaining=lambda: 0.0)
    assert result.abort is not None and result.abort.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "before any pod could be tried" in result.abort.message
    assert pod.headers == []


async def test_the_first_token_budget_leaves_time_for_the_next_pod(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig]
) -> None:
    stalled, good = await start_pod(streams(stall_s=5.0)), await start_pod(OK)
    r = rig([stalled.url, good.url], first_token_timeout_s=30.0)
    deadline = asyncio.get_running_loop().time() + 1.0
    result = await relay_once(
        r,
        [stalled.url, good.url],
        time_remaining=lambda: deadline - asyncio.get_running_loop().time(),
    )
    # The stalled pod got half the remaining second, not the 30 s policy.
    assert result.abort is None and result.outcome.backend == good.url


async def test_headers_reach_every_attempt_and_cannot_replace_the_clients_own(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig]
) -> None:
    bad, good = await start_pod(answers(503)), await start_pod(OK)
    r = rig([bad.url, good.url])
    trace = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "x-request-id": "r-1"}
    hostile = {**trace, "content-type": "text/plain", "User-Agent": "evil"}
    result = await relay_once(r, [bad.url, good.url], headers=hostile)
    assert result.abort is None
    for pod in (bad, good):
        sent = {key.lower(): value for key, value in pod.headers[0].items()}
        assert sent["traceparent"] == trace["traceparent"]
        assert sent["x-request-id"] == "r-1"
        assert sent["content-type"] == "application/json"
        assert sent["user-agent"].startswith("prefix-sidecar/")


async def test_a_text_over_the_message_limit_is_split_between_characters(
    start_pod: Callable[[Handler], Awaitable[Pod]], rig: Callable[..., Rig]
) -> None:
    text = "é" * 3000  # 6,000 UTF-8 bytes
    whole = text_event(text, "stop")
    pod = await start_pod(streams(whole, USAGE, DONE))
    # A message limit just over the event: it passes, but its text needs two Chunks.
    limit = len(whole) + 100
    r = rig([pod.url], max_message_bytes=limit)
    result = await relay_once(r, [pod.url])
    text_limit = limit - 512 - len(pod.url)  # CHUNK_OVERHEAD and the backend url
    assert result.abort is None and result.text == text
    assert len(result.chunks) >= 2
    assert all(len(c.text.encode()) <= text_limit for c in result.chunks)
    assert result.chunks[0].backend == pod.url
    assert [c.finish_reason for c in result.chunks if c.finish_reason] == ["stop"]


def test_split_utf8_cuts_between_characters_within_the_limit() -> None:
    text = "a€😀" * 50
    for limit in (4, 5, 7, 64):
        pieces = split_utf8(text, limit)
        assert "".join(pieces) == text
        assert all(0 < len(p.encode()) <= limit for p in pieces)
    assert split_utf8("short", 64) == ["short"]
