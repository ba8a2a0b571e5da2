"""The systems `bench real --engine vllm` compares, each an async context manager that
yields a Sender (the organic bench's: fill a Result for one request) over one fleet:

  sidecar      a real `prefix-sidecar serve` process; the workload's prefixes registered
               with prewarm over gRPC, every request a streamed POST to its HTTP front,
               which routes a prompt that starts with a registered prefix to its home
  events       the sidecar with kv_events on (the pods publish their KV events when this
               system or precise is among those run): registered prefixes routed and
               re-prewarmed on what the pods hold
  precise      the same with unregistered_routing precise as well
  precise-local  precise with tokenizer_file, the model folder's tokenizer.json: raw
               prompts tokenized in the sidecar, not by a pod's /tokenize
  requests     the sidecar with load counted in requests (load_unit: requests), not tokens
  round-robin  straight to pod seq mod N
  least-loaded straight to the pod with the fewest of this client's requests in flight
  sglang       SGLang's router (`--policy cache_aware`), every request a POST to it

Every system gets the same body (prompt, max_tokens, temperature 0, stream with
include_usage), so TTFT is the first data chunk (completions stream a token in their
first chunk) and the usage is vLLM's own, relayed.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.bench.organic_driver import (
    Result,
    Sender,
    post_streamed,
    scrape_sidecars,
    summed_by,
)
from prefix_sidecar_tools.bench.organic_trace import OrganicRequest
from prefix_sidecar_tools.bench.real_megasale import Prefix
from prefix_sidecar_tools.harness import SidecarProcess, child_env, free_port
from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.vllm.fleet import VllmFleet
from prefix_sidecar_tools.vllm.sglang import SglangRouter, sglang_router_available

PREWARM_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Setup:
    """What every system is given: the fleet, the prefixes to register (none for organic
    traffic), one client session, and the request's knobs."""

    fleet: VllmFleet
    prefixes: Sequence[Prefix]
    session: aiohttp.ClientSession
    max_tokens: int
    first_token_timeout_s: float
    log_dir: Path
    settings: Sequence[str] = ()  # --sidecar-set: more `--set` values for every sidecar
    # What a system reports beside its requests (the sidecar: where each prewarm went).
    notes: dict[str, Any] = field(default_factory=dict)


SystemFactory = Callable[[Setup], AbstractAsyncContextManager[Sender]]


def _poster(setup: Setup, pick: Callable[[OrganicRequest], str]) -> Sender:
    async def send(request: OrganicRequest, result: Result) -> None:
        await post_streamed(
            setup.session,
            pick(request),
            request,
            result,
            chat=False,
            max_tokens=setup.max_tokens,
            first_token_timeout_s=setup.first_token_timeout_s,
            model=setup.fleet.model,
        )

    return send


@contextlib.asynccontextmanager
async def round_robin(setup: Setup) -> AsyncIterator[Sender]:
    turns = itertools.cycle(setup.fleet.urls)
    yield _poster(setup, lambda request: next(turns))


@contextlib.asynccontextmanager
async def least_loaded(setup: Setup) -> AsyncIterator[Sender]:
    """Least connections as a client-side balancer does it: ties go to the lower index."""
    urls = setup.fleet.urls
    in_flight = dict.fromkeys(urls, 0)

    async def send(request: OrganicRequest, result: Result) -> None:
        url = min(urls, key=in_flight.__getitem__)
        in_flight[url] += 1
        try:
            await _poster(setup, lambda _: url)(request, result)
        finally:
            in_flight[url] -= 1

    yield send


@contextlib.asynccontextmanager
async def sglang(setup: Setup) -> AsyncIterator[Sender]:
    async with SglangRouter(setup.fleet.urls, policy="cache_aware") as router:
        yield _poster(setup, lambda request: router.url)


async def register_prewarmed(target: str, prefixes: Sequence[Prefix]) -> list[list[Any]]:
    """Register every prefix with prewarm on the sidecar at `target`; any pod that did not
    warm is an error (the bench would measure a cold start as routing). Returns, per warmed
    pod, [prefix index, pod url, prompt tokens, cached tokens, ms] as the sidecar saw it."""
    warmed: list[list[Any]] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for index, prefix in enumerate(prefixes):
            reply = await stub.RegisterPrefix(
                router_pb2.RegisterPrefixRequest(name=prefix.name, text=prefix.text, prewarm=True),
                timeout=PREWARM_TIMEOUT_S,
            )
            cold = [e for e in reply.prewarm if e.state != router_pb2.PrewarmEvent.WARMED]
            if cold:
                raise RuntimeError(f"prewarm of {prefix.name} failed: {cold}")
            warmed += [
                [index, e.backend, e.prompt_tokens, e.cached_tokens, round(e.elapsed_ms, 1)]
                for e in reply.prewarm
            ]
    return warmed


@contextlib.asynccontextmanager
async def sidecar(setup: Setup, *settings: str) -> AsyncIterator[Sender]:
    """`settings`: more `--set` values for the sidecar."""
    socket_dir = tempfile.mkdtemp(prefix="sc-")  # short: sun_path is ~107 bytes
    try:
        async with contextlib.AsyncExitStack() as stack:
            process, port, metrics_port = await _started(stack, setup, settings, socket_dir)
            setup.notes["prewarm"] = await register_prewarmed(process.target, setup.prefixes)
            front = f"http://127.0.0.1:{port}"
            yield _poster(setup, lambda request: front)
            # Why precise routing kept or moved each request (moved, kept, cold, ...), and
            # the re-prewarms of kv_events by reason (sent, throttled, no_room).
            texts = await scrape_sidecars(setup.session, [metrics_port])
            for note, series, label in NOTED_SERIES:
                counts = summed_by(texts, series, label)
                if counts:
                    setup.notes[note] = {k: int(v) for k, v in counts.items()}
            decisions = logged_decisions(Path(process.log_path))
            if decisions:
                setup.notes["decision_ms"] = {
                    "n": len(decisions),
                    "p50": percentile(decisions, 50),
                    "p99": percentile(decisions, 99),
                    "max": max(decisions),
                }
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)


DECISION_FIELD = re.compile(rb" decision_ms=([0-9.]+)")


def logged_decisions(log: Path) -> list[float]:
    """Each request's time to choose its pod, ms, from the sidecar's request log (its
    histogram's buckets are too coarse for a tail of a few dozen requests): on a small box
    that tail is the run queue behind the pods (--pods-nice)."""
    try:
        text = log.read_bytes()
    except FileNotFoundError:
        return []
    return [float(match[1]) for match in DECISION_FIELD.finditer(text)]


# A port free_port() found can be taken before the sidecar binds it (1 start in ~8 of
# `bench real` on this box): such a start is tried again on new ports.
START_ATTEMPTS = 3


async def _started(
    stack: contextlib.AsyncExitStack, setup: Setup, settings: Sequence[str], socket_dir: str
) -> tuple[SidecarProcess, int, int]:
    """A started sidecar process on the fleet, its OpenAI port and its metrics port."""
    for attempt in range(1, START_ATTEMPTS + 1):
        port, metrics_port = free_port(), free_port()
        argv = [f"--backend={url}" for url in setup.fleet.urls]
        argv += ["--openai-listen", f"127.0.0.1:{port}", "--set", f"model={setup.fleet.model}"]
        argv += ["--set", "health_interval_s=0.5", "--set", "grace_s=1"]
        argv += ["--set", f"metrics_port={metrics_port}"]
        argv += [arg for value in (*setup.settings, *settings) for arg in ("--set", value)]
        process = SidecarProcess(
            f"{socket_dir}/sidecar.sock",
            argv,
            log_path=str(setup.log_dir / f"sidecar-{port}.log"),
            env=child_env(clean=True),
            start_timeout=30.0,
            backends_serving=len(setup.fleet.urls),
        )
        try:
            await stack.enter_async_context(process)
        except RuntimeError as exc:
            if "already in use" not in str(exc).lower() or attempt == START_ATTEMPTS:
                raise
            continue
        return process, port, metrics_port
    raise AssertionError("unreachable")


NOTED_SERIES = (
    ("precise_decisions", "prefix_sidecar_precise_decisions_total", "outcome"),
    ("reprewarms", "prefix_sidecar_reprewarms_total", "reason"),
)


def events(setup: Setup) -> AbstractAsyncContextManager[Sender]:
    return sidecar(setup, "kv_events=true")


def precise(setup: Setup) -> AbstractAsyncContextManager[Sender]:
    return sidecar(setup, "unregistered_routing=precise", "kv_events=true")


def precise_local(setup: Setup) -> AbstractAsyncContextManager[Sender]:
    tokenizer = setup.fleet.model_dir / "tokenizer.json"
    return sidecar(
        setup, "unregistered_routing=precise", "kv_events=true", f"tokenizer_file={tokenizer}"
    )


def requests(setup: Setup) -> AbstractAsyncContextManager[Sender]:
    return sidecar(setup, "load_unit=requests")


SYSTEMS: dict[str, SystemFactory] = {
    "sidecar": sidecar,
    "events": events,
    "precise": precise,
    "precise-local": precise_local,
    "requests": requests,
    "round-robin": round_robin,
    "least-loaded": least_loaded,
    "sglang": sglang,
}


# The systems that read the pods' KV events: the pods publish them when one of these runs.
READ_EVENTS = ("events", "precise", "precise-local")


def default_systems() -> list[str]:
    """Every system but those that read events (named only: they have the pods publish
    events) and requests (named only: a variant of the sidecar), SGLang's router only when
    `sglang-router` is installed."""
    named_only = (*READ_EVENTS, "requests")
    return [
        name
        for name in SYSTEMS
        if name not in named_only and (name != "sglang" or sglang_router_available())
    ]
