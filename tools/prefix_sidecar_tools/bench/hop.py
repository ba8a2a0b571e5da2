"""`prefix-sidecar bench hop`: what the extra hop through the sidecar costs, in one run.

Measured one request at a time, the modes interleaved (so drift hits all alike):
- echo: a bare grpc.aio unary RPC over a unix socket, bytes in and out, served by a tiny
  server process (the transport floor a sidecar call cannot beat);
- route: the sidecar's Route RPC over its unix socket;
- direct: TTFT calling the emulated pod directly (aiohttp streaming POST of the whole
  prompt, the body pre-encoded once: the best case for the caller);
- thin: TTFT through the sidecar with a registered prefix id plus the merchant's input;
- fat: TTFT through the sidecar with the 60k-token text sent in every request;
- http: TTFT through the same sidecar process's OpenAI HTTP front (`openai_listen` on
  127.0.0.1), the same streamed POST /v1/completions as direct, read to the first SSE event;
- proxy: the same POST through a bare aiohttp reverse proxy process (the floor any HTTP hop
  costs: no parsing, no routing; prefix_sidecar_tools/bench/http_proxy.py);
- raw: the same POST through a hand-written asyncio-streams proxy process (no aiohttp, no
  HTTP library at all: what is left is the store-and-forward of the body itself).
With `--frame-ab`, two more modes, the A/B that chose the HTTP front's server frame
(prefix_sidecar_tools/bench/frame_ab.py): the same POST to one trivial handler (read the
body, answer one SSE event) behind the front's own asyncio.Protocol server (frame_http1)
and behind aiohttp's low-level server (frame_aiohttp), each in its own process.
The pod runs at time x1000, so its modelled prefill is microseconds and TTFT differences
are the software path. Then a throughput phase: `--callers` concurrent callers for
`--throughput-seconds` each send small completions (a short prompt, max_tokens 1) through the
gRPC Complete path, the HTTP front (non-streamed) and the bare proxy (non-streamed), one path
after the other against the same pod: requests/s of one sidecar process. A breakdown of
Route's server-side Python cost is timed in-process.
Last, a fast stream: `--fast-streams` callers read a pod that streams tiny SSE events flat
out through a sidecar process; the report gives the pod chunks relayed per second and what
another caller's Route costs meanwhile (prefix_sidecar_tools/bench/fastpod.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import aiohttp
import grpc

from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.bench.children import ready_child
from prefix_sidecar_tools.bench.fastpod import measure_stream_load, render_stream_load
from prefix_sidecar_tools.bench.frame_ab import frame_server
from prefix_sidecar_tools.bench.http_proxy import http_proxy
from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet
from prefix_sidecar_tools.harness import (
    SidecarProcesses,
    free_port,
)
from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.report import (
    add_command,
    add_json_option,
    progress_printer,
    run_and_report,
    target_lines,
)
from prefix_sidecar_tools.workload.driver import CHANNEL_OPTIONS
from prefix_sidecar_tools.workload.texts import merchant_query, rules_text

ECHO_METHOD = "/bench.hop.Echo/Echo"
MODES = ("echo", "route", "direct", "thin", "fat", "http", "proxy", "raw")
FRAME_MODES = ("frame_http1", "frame_aiohttp")  # --frame-ab
PATHS = ("grpc", "http", "proxy")  # the throughput phase
TARGET_ROUTE_OVER_ECHO = 1.10
TARGET_OVERHEAD_MS = 1.0
BODY_STEP = "Complete path: completion_body() for the 240 KB prompt"
SETTLE_S = 0.002  # idle time before each measured call
SMALL_PREFIX = "You are a shop assistant for a mega-sale. Answer in one word.\n\n"


# --- the echo server (a child: `python -m prefix_sidecar_tools.bench.hop echo-server TARGET`) ---


async def _serve_echo(target: str) -> None:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server()
    handler: grpc.RpcMethodHandler[bytes, bytes]
    handler = grpc.unary_unary_rpc_method_handler(echo)  # no (de)serializers: raw bytes
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.hop.Echo", {"Echo": handler}),)
    )
    server.add_insecure_port(target)
    await server.start()
    print("READY", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


@contextlib.asynccontextmanager
async def echo_server(target: str) -> Any:
    module = "prefix_sidecar_tools.bench.hop"
    async with ready_child(module, "echo-server", target, what="the echo server") as (process, _):
        yield process


# --- where Route's server-side time goes (in-process, the sidecar's own objects) --------


def _ns_per_call(function: Callable[[], object], calls: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(calls):
        function()
    return (time.perf_counter_ns() - started) / calls


async def route_breakdown(prefix: str, calls: int) -> dict[str, float]:
    """Microseconds per call of each step of RouterServicer.Route, without gRPC."""
    from prefix_sidecar.config import Config
    from prefix_sidecar.membership.sources import Member
    from prefix_sidecar.server.app import Sidecar
    from prefix_sidecar.server.grpc.servicer import RouterServicer
    from prefix_sidecar.upstream.body import completion_body

    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    sidecar = Sidecar(Config(backends=tuple((url, 1) for url in urls)))
    pool = sidecar.pools.default
    try:
        pool.pool.set_members([Member(url, 1) for url in urls])
        for url in urls:
            pool.pool.set_health(url, True)
        entry, _ = pool.store.register("compliance-rules", prefix, 0)
        servicer = RouterServicer(sidecar.config, sidecar.pools, sidecar.metrics)
        data = router_pb2.RouteRequest(prefix_id=entry.id).SerializeToString()
        request = router_pb2.RouteRequest.FromString(data)
        decision = pool.router.for_prefix(entry)
        histogram = sidecar.metrics.decision
        # ("grpc", "Route") once the series carry a `front` label, else ("Route",)
        labels = tuple(
            {"front": "grpc", "rpc": "Route"}[name]
            for name in getattr(histogram, "_labelnames", ("rpc",))
        )

        def build() -> router_pb2.RouteReply:
            return router_pb2.RouteReply(
                backend=decision.backend,
                preference=decision.preference,
                prefix_id=entry.id,
                route_key=decision.route_key,
                branch=decision.branch,
                decision_ns=decision.decision_ns,
            )

        reply = build()
        steps = {
            "decode RouteRequest (protobuf)": lambda: router_pb2.RouteRequest.FromString(data),
            "request.WhichOneof + store.get(prefix_id)": lambda: (
                request.WhichOneof("target"),
                pool.store.get(request.prefix_id),
            ),
            "router.for_prefix (decision incl. ring.pick)": lambda: pool.router.for_prefix(entry),
            "metrics: decision.labels('Route').observe()": lambda: histogram.labels(
                *labels
            ).observe(1e-6),
            "build RouteReply": build,
            "encode RouteReply (protobuf)": reply.SerializeToString,
        }
        result = {name: _ns_per_call(step, calls) / 1e3 for name, step in steps.items()}
        user_input = "\n\nMerchant 10001 asks: is this 499 yuan down jacket offer compliant?" * 11
        result[BODY_STEP] = (
            _ns_per_call(
                lambda: completion_body(entry.json_bytes, user_input, {"max_tokens": 1}, ""),
                max(1, calls // 20),
            )
            / 1e3
        )

        async def noop() -> None:
            return None

        started = time.perf_counter_ns()
        for _ in range(calls):
            await servicer.Route(request, cast(grpc.aio.ServicerContext, None))
        result["servicer.Route whole (awaited, no gRPC)"] = (
            (time.perf_counter_ns() - started) / calls / 1e3
        )
        started = time.perf_counter_ns()
        for _ in range(calls):
            await noop()
        result["(baseline: await a no-op coroutine)"] = (
            (time.perf_counter_ns() - started) / calls / 1e3
        )
        return result
    finally:
        await pool.client.close()


# --- the measured calls ---------------------------------------------------------------


async def _first_chunk(stub: router_pb2_grpc.RouterStub, request: Any) -> float:
    started = time.perf_counter_ns()
    call = stub.Complete(request, timeout=30)
    first = await call.read()
    elapsed = time.perf_counter_ns() - started
    if first is grpc.aio.EOF:
        raise RuntimeError("the sidecar ended the stream without a chunk")
    while await call.read() is not grpc.aio.EOF:
        pass
    return float(elapsed)


async def _first_event(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    started = time.perf_counter_ns()
    async with session.post(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    ) as response:
        if response.status != 200:
            raise RuntimeError(f"the pod answered {response.status}: {await response.text()}")
        elapsed = None
        async for line in response.content:
            if elapsed is None and line.startswith(b"data: "):
                elapsed = time.perf_counter_ns() - started
        if elapsed is None:
            raise RuntimeError("the pod sent no SSE event")
    return float(elapsed)


def _direct_body(prompt: str, model: str) -> bytes:
    return json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        ensure_ascii=False,
    ).encode()


async def _wait_http_ready(session: aiohttp.ClientSession, url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(f"{url}/health") as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the sidecar's OpenAI front at {url} was not ready")
        await asyncio.sleep(0.05)


async def _whole_completion(session: aiohttp.ClientSession, url: str, body: bytes) -> None:
    async with session.post(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    ) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}")


async def _grpc_completion(stub: router_pb2_grpc.RouterStub, request: Any) -> None:
    call = stub.Complete(request, timeout=30)
    while await call.read() is not grpc.aio.EOF:
        pass


async def throughput(
    send: Callable[[int], Awaitable[None]], callers: int, seconds: float
) -> dict[str, Any]:
    """`callers` loops calling `send` back to back for `seconds`: requests/s and latency."""
    latencies: list[float] = []
    errors = 0
    started = time.perf_counter()
    deadline = started + seconds

    async def caller(k: int) -> None:
        nonlocal errors
        i = k
        while time.perf_counter() < deadline:
            begun = time.perf_counter_ns()
            try:
                await send(i)
            except (aiohttp.ClientError, grpc.aio.AioRpcError, RuntimeError):
                errors += 1
            else:
                latencies.append(float(time.perf_counter_ns() - begun))
            i += callers

    await asyncio.gather(*(caller(k) for k in range(callers)))
    elapsed = time.perf_counter() - started
    return {
        "callers": callers,
        "seconds": elapsed,
        "requests": len(latencies),
        "errors": errors,
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": percentile(latencies, 50) / 1e6 if latencies else float("nan"),
        "p99_ms": percentile(latencies, 99) / 1e6 if latencies else float("nan"),
    }


async def measure(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    import random

    prefix = rules_text(60_000, seed=args.seed)
    rng = random.Random(args.seed)
    inputs = [merchant_query(rng) for _ in range(args.warmup + args.iterations)]
    config = EmulatorConfig(time_scale=1000.0, kv_tokens=400_000)
    modes = MODES + (FRAME_MODES if args.frame_ab else ())
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    front = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="prefix-sidecar-hop-") as workdir:
        echo_target = f"unix://{workdir}/echo.sock"
        async with (
            EmulatorFleet(1, config) as fleet,
            SidecarProcesses(
                1,
                fleet.urls,
                "prefix_affinity",
                {"log_level": args.log_level, "grace_s": 1, "openai_listen": front},
                stderr_path=f"{workdir}/sidecar.log",
            ) as sidecars,
            http_proxy(fleet.urls[0]) as proxy,
            http_proxy(fleet.urls[0], raw=True) as raw_proxy,
            echo_server(echo_target),
            grpc.aio.insecure_channel(sidecars.targets[0], options=CHANNEL_OPTIONS) as channel,
            grpc.aio.insecure_channel(echo_target) as echo_channel,
            aiohttp.ClientSession() as session,
            contextlib.AsyncExitStack() as frames,
        ):
            frame_urls = {
                mode: await frames.enter_async_context(frame_server(mode[len("frame_") :]))
                for mode in samples
                if mode in FRAME_MODES
            }
            pod = fleet.urls[0]
            front_url = f"http://{front}"
            await _wait_http_ready(session, front_url, 20)
            stub = router_pb2_grpc.RouterStub(channel)
            registered = await stub.RegisterPrefix(
                router_pb2.RegisterPrefixRequest(name="compliance-rules", text=prefix, prewarm=True)
            )
            prefix_id = registered.id
            route_request = router_pb2.RouteRequest(prefix_id=prefix_id)
            echo: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]
            echo = echo_channel.unary_unary(ECHO_METHOD)
            reply_size = len((await stub.Route(route_request)).SerializeToString())
            payload = os.urandom(reply_size)
            progress(
                f"pod {pod}, sidecar {sidecars.targets[0]} and {front_url}, proxy {proxy}, "
                f"echo {echo_target}"
            )

            async def time_echo(_: int) -> float:
                started = time.perf_counter_ns()
                await echo(payload)
                return float(time.perf_counter_ns() - started)

            async def time_route(_: int) -> float:
                started = time.perf_counter_ns()
                await stub.Route(route_request)
                return float(time.perf_counter_ns() - started)

            async def time_direct(i: int) -> float:
                return await _first_event(session, pod, bodies[i])

            async def time_thin(i: int) -> float:
                request = router_pb2.CompleteRequest(
                    prefix_id=prefix_id, input=inputs[i], max_tokens=1, temperature=0.0
                )
                return await _first_chunk(stub, request)

            async def time_fat(i: int) -> float:
                request = router_pb2.CompleteRequest(
                    prefix_text=prefix, input=inputs[i], max_tokens=1, temperature=0.0
                )
                return await _first_chunk(stub, request)

            async def time_http(i: int) -> float:
                return await _first_event(session, front_url, bodies[i])

            async def time_proxy(i: int) -> float:
                return await _first_event(session, proxy, bodies[i])

            async def time_raw(i: int) -> float:
                return await _first_event(session, raw_proxy, bodies[i])

            def time_frame(mode: str) -> Callable[[int], Awaitable[float]]:
                return lambda i: _first_event(session, frame_urls[mode], bodies[i])

            bodies = [_direct_body(prefix + text, config.model) for text in inputs]
            calls: dict[str, Callable[[int], Awaitable[float]]] = {
                "echo": time_echo,
                "route": time_route,
                "direct": time_direct,
                "thin": time_thin,
                "fat": time_fat,
                "http": time_http,
                "proxy": time_proxy,
                "raw": time_raw,
                **{mode: time_frame(mode) for mode in frame_urls},
            }
            total = args.warmup + args.iterations
            order = list(samples)
            for i in range(total):
                # A fresh random order every round, and a pause before every call: the
                # teardown of one call (a finished stream, a 240 KB message) must not be
                # billed to whichever mode always follows it.
                rng.shuffle(order)
                for mode in order:
                    await asyncio.sleep(SETTLE_S)
                    value = await calls[mode](i)
                    if i >= args.warmup:
                        samples[mode].append(value)
                if (i + 1) % max(1, total // 5) == 0:
                    progress(f"{i + 1}/{total} rounds")
            wire = {
                "thin": len(
                    router_pb2.CompleteRequest(
                        prefix_id=prefix_id, input=inputs[0], max_tokens=1
                    ).SerializeToString()
                ),
                "fat": len(
                    router_pb2.CompleteRequest(
                        prefix_text=prefix, input=inputs[0], max_tokens=1
                    ).SerializeToString()
                ),
                "direct": len(bodies[0]),
            }
            small = [SMALL_PREFIX + text for text in inputs]
            small_bodies = [
                json.dumps(
                    {"model": config.model, "prompt": text, "max_tokens": 1, "temperature": 0.0},
                    ensure_ascii=False,
                ).encode()
                for text in small
            ]
            small_requests = [
                router_pb2.CompleteRequest(
                    prefix_text=SMALL_PREFIX, input=text, max_tokens=1, temperature=0.0
                )
                for text in inputs
            ]
            sends: dict[str, Callable[[int], Awaitable[None]]] = {
                "grpc": lambda i: _grpc_completion(stub, small_requests[i % len(inputs)]),
                "http": lambda i: _whole_completion(session, front_url, small_bodies[i % total]),
                "proxy": lambda i: _whole_completion(session, proxy, small_bodies[i % total]),
            }
            rates: dict[str, Any] = {}
            for path in PATHS:
                progress(
                    f"throughput via {path}: {args.callers} callers for "
                    f"{args.throughput_seconds:g} s"
                )
                await sends[path](0)  # connections up before the clock starts
                rates[path] = await throughput(sends[path], args.callers, args.throughput_seconds)
    progress("route breakdown (in-process)")
    breakdown = await route_breakdown(prefix, args.breakdown_calls)
    progress(f"fast stream: {args.fast_streams} callers for {args.fast_seconds:g} s")
    report = _report(args, samples, wire, breakdown)
    report["throughput"] = rates
    report["fast_stream"] = await measure_stream_load(
        args.fast_streams, args.fast_seconds, {"log_level": args.log_level}
    )
    return report


def _report(
    args: argparse.Namespace,
    samples: dict[str, list[float]],
    wire: dict[str, int],
    breakdown: dict[str, float],
) -> dict[str, Any]:
    stats = {
        mode: {
            "p50_us": percentile(values, 50) / 1e3,
            "p99_us": percentile(values, 99) / 1e3,
            "mean_us": sum(values) / len(values) / 1e3,
            "n": len(values),
        }
        for mode, values in samples.items()
    }
    route_ratio = stats["route"]["p50_us"] / stats["echo"]["p50_us"]
    overhead_ms = (stats["thin"]["p50_us"] - stats["direct"]["p50_us"]) / 1e3
    http_ms = (stats["http"]["p50_us"] - stats["direct"]["p50_us"]) / 1e3
    saving_ms = (stats["fat"]["p50_us"] - stats["thin"]["p50_us"]) / 1e3
    proxy_ms = (stats["proxy"]["p50_us"] - stats["direct"]["p50_us"]) / 1e3
    return {
        "params": {k: v for k, v in vars(args).items() if k not in ("func", "command")},
        "latency": stats,
        "ratios": {
            "route_over_echo_p50": route_ratio,
            "route_over_echo_p99": stats["route"]["p99_us"] / stats["echo"]["p99_us"],
            "thin_over_direct_p50": stats["thin"]["p50_us"] / stats["direct"]["p50_us"],
            "fat_over_thin_p50": stats["fat"]["p50_us"] / stats["thin"]["p50_us"],
        },
        "sidecar_overhead_ms": {
            "p50": overhead_ms,
            "p99": (stats["thin"]["p99_us"] - stats["direct"]["p99_us"]) / 1e3,
        },
        "http_overhead_ms": {
            mode: {
                "p50": (stats[mode]["p50_us"] - stats["direct"]["p50_us"]) / 1e3,
                "p99": (stats[mode]["p99_us"] - stats["direct"]["p99_us"]) / 1e3,
            }
            for mode in ("http", "proxy", "raw", *FRAME_MODES)
            if mode in stats
        },
        "thin_saving": {
            "p50_ms": saving_ms,
            "p99_ms": (stats["fat"]["p99_us"] - stats["thin"]["p99_us"]) / 1e3,
            "request_bytes": wire,
        },
        "route_breakdown_us": breakdown,
        "targets": [
            {
                "name": f"Route p50 <= {TARGET_ROUTE_OVER_ECHO:.2f}x the echo floor",
                "measured": f"{route_ratio:.2f}x ({stats['route']['p50_us']:.0f} us vs "
                f"{stats['echo']['p50_us']:.0f} us)",
                "met": route_ratio <= TARGET_ROUTE_OVER_ECHO,
            },
            {
                "name": f"sidecar TTFT overhead <= {TARGET_OVERHEAD_MS:g} ms at p50 over the pod",
                "measured": f"{overhead_ms:.2f} ms",
                "met": overhead_ms <= TARGET_OVERHEAD_MS,
            },
            {
                "name": f"HTTP front TTFT overhead <= {TARGET_OVERHEAD_MS:g} ms at p50 over "
                "the pod",
                "measured": f"{http_ms:.2f} ms (bare aiohttp proxy: "
                f"{(stats['proxy']['p50_us'] - stats['direct']['p50_us']) / 1e3:.2f} ms, "
                f"raw-socket proxy: "
                f"{(stats['raw']['p50_us'] - stats['direct']['p50_us']) / 1e3:.2f} ms)",
                "met": http_ms <= TARGET_OVERHEAD_MS,
            },
            {
                "name": "HTTP front TTFT overhead below the bare aiohttp proxy's (p50, this run)",
                "measured": f"{http_ms:.2f} ms vs {proxy_ms:.2f} ms",
                "met": http_ms < proxy_ms,
            },
        ],
    }


def render(report: dict[str, Any]) -> str:
    latency = report["latency"]
    labels = {
        "echo": "bare grpc.aio echo (unix socket)",
        "route": "sidecar Route",
        "direct": "TTFT, pod called directly",
        "thin": "TTFT via sidecar, thin (prefix id)",
        "fat": "TTFT via sidecar, fat (60k-token text)",
        "http": "TTFT via sidecar's OpenAI HTTP front",
        "proxy": "TTFT via a bare aiohttp proxy",
        "raw": "TTFT via a raw-socket proxy (no aiohttp)",
    }
    lines = [
        f"prefix-sidecar bench hop: {latency['echo']['n']} rounds, one call at a time, "
        f"sidecar log level {report['params']['log_level']}"
        + ("  [--quick]" if report["params"]["quick"] else ""),
        "",
        f"{'':<42}{'p50 us':>10}{'p99 us':>10}",
    ]
    for mode, label in labels.items():
        lines.append(
            f"{label:<42}{latency[mode]['p50_us']:>10,.0f}{latency[mode]['p99_us']:>10,.0f}"
        )
    ratios, overhead, saving = (
        report["ratios"],
        report["sidecar_overhead_ms"],
        report["thin_saving"],
    )
    wire = saving["request_bytes"]
    http = report["http_overhead_ms"]
    floor_ms = latency["echo"]["p50_us"] / 1e3
    body_ms = report["route_breakdown_us"][BODY_STEP] / 1e3
    rest_ms = overhead["p50"] - floor_ms - body_ms
    lines += [
        "",
        f"Route / echo: p50 {ratios['route_over_echo_p50']:.2f}x, "
        f"p99 {ratios['route_over_echo_p99']:.2f}x",
        f"sidecar TTFT overhead over the pod: p50 {overhead['p50']:.2f} ms, "
        f"p99 {overhead['p99']:.2f} ms",
        f"thin query saves {saving['p50_ms']:.2f} ms at p50 ({ratios['fat_over_thin_p50']:.2f}x) "
        f"and sends {wire['thin']:,} bytes instead of {wire['fat']:,} per request",
        f"overhead accounting at p50: gRPC floor (echo) {floor_ms:.2f} ms + "
        f"completion_body() {body_ms:.2f} ms + the rest {rest_ms:.2f} ms",
        f"HTTP front TTFT overhead over the pod: p50 {http['http']['p50']:.2f} ms, "
        f"p99 {http['http']['p99']:.2f} ms; bare proxy (the HTTP floor): p50 "
        f"{http['proxy']['p50']:.2f} ms, p99 {http['proxy']['p99']:.2f} ms; raw-socket proxy "
        f"(the store-and-forward floor): p50 {http['raw']['p50']:.2f} ms, "
        f"p99 {http['raw']['p99']:.2f} ms",
        "",
        "Route server-side Python cost, in-process (us per call)",
    ]
    for name, value in report["route_breakdown_us"].items():
        lines.append(f"  {name:<52}{value:>8.2f}")
    if "frame_http1" in latency:
        ab = {mode: latency[mode]["p50_us"] for mode in FRAME_MODES}
        lines += [
            "",
            "server frame A/B (--frame-ab): one trivial handler, the same POST, p50 us (p99)",
            f"  behind the front's asyncio.Protocol server (http1)  {ab['frame_http1']:>8,.0f}"
            f" ({latency['frame_http1']['p99_us']:,.0f})",
            f"  behind aiohttp's low-level server                   {ab['frame_aiohttp']:>8,.0f}"
            f" ({latency['frame_aiohttp']['p99_us']:,.0f})",
            f"  http1 - aiohttp: {ab['frame_http1'] - ab['frame_aiohttp']:+,.0f} us per request",
        ]
    if "throughput" in report:
        rates = report["throughput"]
        first = rates[PATHS[0]]
        lines += [
            "",
            f"throughput: small completions (max_tokens 1), {first['callers']} callers, "
            f"{first['seconds']:.1f} s per path, one path at a time",
            f"{'':<42}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}",
        ]
        path_labels = {
            "grpc": "sidecar gRPC Complete",
            "http": "sidecar OpenAI HTTP front",
            "proxy": "bare aiohttp proxy (floor)",
        }
        for path, label in path_labels.items():
            rate = rates[path]
            lines.append(
                f"{label:<42}{rate['requests_per_s']:>10,.0f}{rate['p50_ms']:>10.2f}"
                f"{rate['p99_ms']:>10.2f}{rate['errors']:>8}"
            )
    lines += ["", "targets (as measured in this run)"]
    lines += target_lines(report["targets"])
    if "fast_stream" in report:
        lines += ["", *render_stream_load(report["fast_stream"])]
    return "\n".join(lines)


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    summary = "the sidecar hop: Route vs a bare gRPC echo, TTFT via sidecar vs direct, thin vs fat"
    parser = add_command(bench_subparsers, "hop", summary, __doc__)
    parser.add_argument("--iterations", type=int, default=1000, help="measured rounds (1000)")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured rounds first (50)")
    parser.add_argument(
        "--breakdown-calls", type=int, default=20_000, help="in-process Route calls timed"
    )
    parser.add_argument(
        "--log-level", default="info", help="the sidecar's log_level (info, its default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fast-streams", type=int, default=8, help="callers of the fast-stream phase (8)"
    )
    parser.add_argument(
        "--fast-seconds", type=float, default=5.0, help="length of the fast-stream phase (5)"
    )
    parser.add_argument(
        "--callers", type=int, default=16, help="concurrent callers of the throughput phase (16)"
    )
    parser.add_argument(
        "--throughput-seconds",
        type=float,
        default=5.0,
        help="length of the throughput phase, per path (5)",
    )
    parser.add_argument(
        "--frame-ab",
        action="store_true",
        help="also time one trivial handler behind the front's server and behind aiohttp's "
        "(the A/B that chose the front's server frame)",
    )
    parser.add_argument("--quick", action="store_true", help="a few seconds, for tests")
    add_json_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.iterations, args.warmup, args.breakdown_calls = 30, 5, 2000
        args.fast_seconds = min(args.fast_seconds, 2.0)
        args.throughput_seconds = min(args.throughput_seconds, 1.0)
        args.callers = min(args.callers, 4)
    if (
        args.iterations < 1
        or args.warmup < 0
        or args.breakdown_calls < 1
        or args.fast_streams < 1
        or not args.fast_seconds >= 1
        or args.callers < 1
        or not args.throughput_seconds > 0
    ):
        print(
            "prefix-sidecar bench hop: --iterations, --breakdown-calls, --fast-streams and "
            "--callers must be >= 1, --warmup >= 0, --fast-seconds >= 1, "
            "--throughput-seconds > 0",
            file=sys.stderr,
        )
        return 2

    report = run_and_report(
        "bench hop", measure(args, progress_printer("bench hop")), render, args.json
    )
    return 130 if report is None else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "echo-server":
        asyncio.run(_serve_echo(sys.argv[2]))
    else:
        print(
            "usage: python -m prefix_sidecar_tools.bench.hop echo-server unix:///path.sock",
            file=sys.stderr,
        )
        sys.exit(2)
