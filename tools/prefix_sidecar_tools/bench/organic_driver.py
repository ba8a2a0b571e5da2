"""Sending the organic trace: the paths, the flows, and what the pods and sidecars report.

Paths (one per run, selectable):
- grpc-complete: the sidecar's Complete RPC with the whole prompt as `input` (a raw prompt);
- grpc-chat: the sidecar's Chat RPC with the messages (no prefix);
- http-complete / http-chat: the sidecar's OpenAI front (`serve --openai-listen`), POST
  /v1/completions with the prompt or /v1/chat/completions with the messages, streamed.
The central radix router (organic_radix) picks a pod in this process and POSTs the same
body straight to it, as a central router would (without a router hop of its own); K
replicas of it, each with its own tree, take the requests as K sidecars do.

Flows run closed loop: a session's next turn is sent `gap_s` modelled seconds after the
previous answer ended; one-shots are flows of one. TTFT is from the send to the first
chunk. With K sidecars each request goes to a sidecar drawn at random (seeded by its
sequence number), so the turns of one session meet different sidecars, as the replicas of
a stateless web tier would send them.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc

from prefix_sidecar.lifecycle import AsyncService
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.bench.organic_radix import CacheAwareRouter
from prefix_sidecar_tools.bench.organic_trace import OrganicRequest, OrganicTrace, router_of
from prefix_sidecar_tools.harness import STDERR, SidecarProcess, free_port
from prefix_sidecar_tools.tuned import serve_settings
from prefix_sidecar_tools.workload.driver import TIMEOUT, StreamRecord, read_stream

PATHS = ("grpc-complete", "grpc-chat", "http-complete", "http-chat")
STREAM_TIMEOUT = "STREAM_TIMEOUT"  # the first token came, the end did not
STREAM_TIMEOUT_FACTOR = 2.0  # a whole stream may take this many first-token timeouts
BACKEND_HEADER = "x-prefix-sidecar-backend"


@dataclass
class Result(StreamRecord):
    """One request of the organic trace: its class and the sidecar it went through (-1: none,
    the central router)."""

    seq: int
    kind: str
    sidecar: int = -1


Sender = Callable[[OrganicRequest, Result], Awaitable[None]]


READY_TIMEOUT_S = 30.0

# --- the sidecars --------------------------------------------------------------------------


class SidecarGroup(AsyncService):
    """K `prefix-sidecar serve` processes before one fleet, each with its own gRPC socket,
    metrics port and (if asked) OpenAI front port; ready when every pod is `serving`."""

    def __init__(
        self,
        count: int,
        backends: Sequence[str],
        settings: dict[str, object],
        *,
        socket_dir: str,
        http_front: bool,
    ) -> None:
        self.backends = list(backends)
        self.metrics_ports = [free_port() for _ in range(count)]
        self.http_ports = [free_port() for _ in range(count)] if http_front else []
        self.sidecars: list[SidecarProcess] = []
        base = [arg for url in self.backends for arg in ("--backend", url)]
        flags, launcher = serve_settings(
            {"health_interval_s": 0.5, "log_level": "warning", **settings}
        )
        base += flags
        for i in range(count):
            args = [*base, "--set", f"metrics_port={self.metrics_ports[i]}"]
            if http_front:
                args += ["--openai-listen", f"127.0.0.1:{self.http_ports[i]}"]
            self.sidecars.append(
                SidecarProcess(
                    f"{socket_dir}/organic-{i}.sock",
                    args,
                    log_path=STDERR,
                    launcher=launcher,
                    start_timeout=30.0,
                    backends_serving=len(self.backends),
                )
            )

    @property
    def targets(self) -> list[str]:
        return [sidecar.target for sidecar in self.sidecars]

    @property
    def http_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.http_ports]

    async def start(self) -> None:
        results = await asyncio.gather(
            *(sidecar.start() for sidecar in self.sidecars), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                await self.stop()
                raise result
        try:
            await asyncio.wait_for(self._ready(), READY_TIMEOUT_S)
        except BaseException:
            await self.stop()
            raise

    async def _ready(self) -> None:
        """Until every sidecar's /readyz says 200, as a Kubernetes readiness probe waits
        (with kv_events, until each has read the pods' KV-event history)."""
        async with aiohttp.ClientSession() as session:
            for port in self.metrics_ports:
                while True:
                    async with session.get(f"http://127.0.0.1:{port}/readyz") as answer:
                        if answer.status == 200:
                            break
                    await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await asyncio.gather(*(sidecar.stop(5.0) for sidecar in self.sidecars))


# --- senders -------------------------------------------------------------------------------


def grpc_sender(
    channels: Sequence[grpc.aio.Channel],
    path: str,
    max_tokens: int,
    first_token_timeout_s: float,
    pin_flows: bool = False,
) -> Sender:
    stubs = [router_pb2_grpc.RouterStub(channel) for channel in channels]

    async def send(request: OrganicRequest, result: Result) -> None:
        result.sidecar = router_of(request, len(stubs), pin_flows)
        stub = stubs[result.sidecar]
        call: Any
        whole_call_s = STREAM_TIMEOUT_FACTOR * first_token_timeout_s  # grpc's own deadline
        if path == "grpc-complete":
            message: Any = router_pb2.CompleteRequest(
                input=request.prompt, max_tokens=max_tokens, temperature=0.0
            )
            started = time.perf_counter()
            call = stub.Complete(message, timeout=whole_call_s)
        else:
            messages = [router_pb2.ChatMessage(role=r, content=c) for r, c in request.messages]
            message = router_pb2.ChatRequest(
                messages=messages, max_tokens=max_tokens, temperature=0.0
            )
            started = time.perf_counter()
            call = stub.Chat(message, timeout=whole_call_s)
        await read_stream(call, result, started, first_token_timeout_s)

    return send


def http_body(
    request: OrganicRequest, chat: bool, max_tokens: int, model: str = ""
) -> dict[str, Any]:
    """The streamed body of one request; `model` named only when given (a pod or the
    sidecar takes its default, SGLang's router requires it)."""
    body: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if chat:
        body["messages"] = request.message_dicts()
    else:
        body["prompt"] = request.prompt
    return body


async def post_streamed(
    session: aiohttp.ClientSession,
    base_url: str,
    request: OrganicRequest,
    result: Result,
    *,
    chat: bool,
    max_tokens: int,
    first_token_timeout_s: float,
    model: str = "",
) -> None:
    """POST one streamed completion; fills ttft, usage and the backend (header or url)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    started = time.perf_counter()
    try:
        async with asyncio.timeout(first_token_timeout_s) as deadline:
            response = await session.post(
                base_url + path, json=http_body(request, chat, max_tokens, model)
            )
            try:
                result.backend = response.headers.get(BACKEND_HEADER, base_url)
                if response.status != 200:
                    text = (await response.content.read(300)).decode("utf-8", "replace")
                    result.error = f"HTTP_{response.status}: {text}"
                    return
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    if math.isnan(result.ttft_s):
                        result.ttft_s = time.perf_counter() - started
                        deadline.reschedule(  # the rest of the stream is bounded too
                            asyncio.get_running_loop().time()
                            + (STREAM_TIMEOUT_FACTOR - 1) * first_token_timeout_s
                        )
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        continue  # read on to the end of the body: the connection is reused
                    usage = json.loads(data).get("usage")
                    if usage:
                        result.prompt_tokens = int(usage.get("prompt_tokens", 0))
                        details = usage.get("prompt_tokens_details") or {}
                        result.cached_tokens = int(details.get("cached_tokens", 0))
                result.total_s = time.perf_counter() - started
            finally:
                response.release()
    except TimeoutError:
        result.error = TIMEOUT if math.isnan(result.ttft_s) else STREAM_TIMEOUT
    except (aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"


def http_front_sender(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    chat: bool,
    max_tokens: int,
    first_token_timeout_s: float,
    pin_flows: bool = False,
    model: str = "",
) -> Sender:
    """Each request POSTed to one of the OpenAI fronts at `urls` (the sidecars' or SGLang
    routers'), drawn as for the gRPC sidecars."""

    async def send(request: OrganicRequest, result: Result) -> None:
        result.sidecar = router_of(request, len(urls), pin_flows)
        await post_streamed(
            session,
            urls[result.sidecar],
            request,
            result,
            chat=chat,
            max_tokens=max_tokens,
            first_token_timeout_s=first_token_timeout_s,
            model=model,
        )

    return send


def central_sender(
    session: aiohttp.ClientSession,
    routers: Sequence[CacheAwareRouter],
    chat: bool,
    max_tokens: int,
    first_token_timeout_s: float,
    decisions_ns: list[int],
    pin_flows: bool = False,
) -> Sender:
    """The central router: decide here (timed), then POST straight to the chosen pod. With
    several (replicas, each with its own tree), each request goes to one drawn at random as
    a request goes to one of K sidecars."""

    async def send(request: OrganicRequest, result: Result) -> None:
        router = routers[router_of(request, len(routers), pin_flows)]
        router.evict_if_due()
        started = time.perf_counter_ns()
        pod = router.select(request.prompt)
        decisions_ns.append(time.perf_counter_ns() - started)
        router.started(pod)
        try:
            await post_streamed(
                session,
                pod,
                request,
                result,
                chat=chat,
                max_tokens=max_tokens,
                first_token_timeout_s=first_token_timeout_s,
            )
        finally:
            router.finished(pod)
        result.backend = pod

    return send


# --- the replay ----------------------------------------------------------------------------


async def replay(trace: OrganicTrace, send: Sender, time_scale: float) -> list[Result]:
    """Every flow at its start time, its turns closed loop; results in trace order."""
    results = [Result(r.seq, r.kind) for r in trace.requests]
    origin = time.perf_counter()

    async def run_flow(flow_start: float, requests: Sequence[OrganicRequest]) -> None:
        delay = origin + flow_start / time_scale - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        for request in requests:
            if request.turn:
                await asyncio.sleep(request.gap_s / time_scale)
            result = results[request.seq]
            result.sent_at = time.perf_counter() - origin
            await send(request, result)

    await asyncio.gather(*(run_flow(f.start_s, f.requests) for f in trace.flows))
    return results


# --- what the pods and sidecars report -----------------------------------------------------


async def _get_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
        return await response.text()


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of `name` in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    found: list[tuple[dict[str, str], float]] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found.append((dict(sample.labels), float(sample.value)))
    return found


async def pod_requests(session: aiohttp.ClientSession, urls: Sequence[str]) -> dict[str, int]:
    """Each pod's inference request counter (GET /admin/stats)."""

    async def one(url: str) -> int:
        async with session.get(f"{url}/admin/stats") as response:
            return int((await response.json())["requests"])

    counts = await asyncio.gather(*(one(url) for url in urls))
    return dict(zip(urls, counts, strict=True))


class InFlightSampler:
    """Samples each pod's running requests (vllm:num_requests_running) every `interval_s`
    real seconds while a run lasts: 4 small GETs per sample, cheap next to the traffic."""

    def __init__(
        self, session: aiohttp.ClientSession, urls: Sequence[str], interval_s: float = 0.25
    ) -> None:
        self.session = session
        self.urls = list(urls)
        self.interval_s = interval_s
        self.samples: dict[str, list[float]] = {url: [] for url in self.urls}
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            texts = await asyncio.gather(
                *(_get_text(self.session, f"{url}/metrics") for url in self.urls),
                return_exceptions=True,
            )
            for url, text in zip(self.urls, texts, strict=True):
                if isinstance(text, str):
                    values = metric_samples(text, "vllm:num_requests_running")
                    if values:
                        self.samples[url].append(values[0][1])
            await asyncio.sleep(self.interval_s)

    def __enter__(self) -> InFlightSampler:
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    def means(self) -> dict[str, float]:
        return {url: (sum(v) / len(v) if v else 0.0) for url, v in self.samples.items()}


async def scrape_sidecars(
    session: aiohttp.ClientSession, metrics_ports: Sequence[int]
) -> list[str]:
    """Every sidecar's /metrics text."""
    return [await _get_text(session, f"http://127.0.0.1:{port}/metrics") for port in metrics_ports]


def summed_by(texts: Sequence[str], name: str, label: str) -> dict[str, float]:
    """One series summed over sidecars (and every other label), by one label's value."""
    total: dict[str, float] = {}
    for text in texts:
        for labels, value in metric_samples(text, name):
            total[labels[label]] = total.get(labels[label], 0.0) + value
    return total


def decision_buckets(texts: Sequence[str]) -> dict[float, float]:
    """The sidecars' decision-time histogram, summed over sidecars, fronts and RPCs:
    upper bound (seconds) -> cumulative count."""
    buckets = summed_by(texts, "prefix_sidecar_decision_seconds_bucket", "le")
    return {float(bound): count for bound, count in buckets.items()}


def bucket_percentile(buckets: dict[float, float], q: float) -> float:
    """The upper bound (seconds) of the histogram bucket holding the q-th percentile."""
    ordered = sorted(buckets.items())
    count = ordered[-1][1] if ordered else 0.0
    if count <= 0:
        return math.nan
    for bound, cumulative in ordered:
        if cumulative >= q / 100 * count:
            return bound
    return math.inf
