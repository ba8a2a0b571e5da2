"""`prefix-sidecar bench soak`: many concurrent streams for a while, and the sidecar's footprint.

A sidecar runs in every caller's pod, so what it costs at rest and under peak matters as
much as its latency. The soak runs the sidecar as a real `prefix-sidecar serve` child
process, so /proc/PID/status (VmRSS) and /proc/PID/fd measure the sidecar alone; the load
generator (this process) and the emulated pods (their own processes, at a high time scale so
they are not the bottleneck) are outside it. Phases:

  1. idle: pods serving, nothing registered -> idle RSS (target <= 80 MB);
  2. optional `--prefixes N`: N registered prefixes of `--prefix-tokens` tokens each;
  3. load: `--concurrency` workers each keep one Complete stream open at a time, for
     `--seconds` (and at most `--max-requests`); RSS and fds are sampled all along;
  4. checks: 0 errors; after `--warmup` seconds RSS grows by at most 5 % and the fd count
     does not grow; with 100+ prefixes and 1,000+ streams, peak RSS <= 150 MB.

`--tracemalloc FILE` runs the sidecar under tracemalloc (this harness only: the sidecar
itself has no such switch) and writes its top allocation sites at the end of the load to
FILE, to see where memory goes. Traced RSS is inflated by tracemalloc's own bookkeeping.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from prefix_sidecar_tools.bench.argtypes import non_negative, positive_float, positive_int
from prefix_sidecar_tools.harness import SERVE, SidecarProcess
from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.report import (
    add_command,
    add_json_option,
    progress_printer,
    run_and_report,
)

MB = 1024 * 1024
IDLE_RSS_LIMIT_MB = 80.0
LOADED_RSS_LIMIT_MB = 150.0
RSS_GROWTH_LIMIT_PCT = 5.0
# The aiohttp pool keeps one connection per stream in flight to a pod, so its size is a
# high-water mark that jitters by a few as bursts come and go; a leak of one fd per request
# would add thousands. "Does not grow" allows that jitter and nothing more.
FD_JITTER = 0.02
BYTES_PER_TOKEN = 4  # the emulator's tokenizer (prefix_sidecar_tools/emulator/tokenizer.py)


# --- the sidecar's footprint, read from /proc ---------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


def fd_count(pid: int) -> int:
    """Open file descriptors of a process (sockets, pipes, files, epoll...)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def memory_breakdown(pid: int) -> dict[str, float]:
    """Where the RSS is, in MB, from /proc/PID/smaps_rollup: anonymous (the Python heap,
    arenas, buffers) versus file-backed (shared libraries, mostly grpc and Python)."""
    wanted = {"Rss", "Anonymous", "Shared_Clean", "Private_Clean", "Private_Dirty"}
    result: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in wanted:
            result[name.lower() + "_mb"] = round(int(rest.split()[0]) / 1024, 1)
    return result


# --- `serve` under tracemalloc (the sidecar runs as a harness.SidecarProcess) -------------


def _traced_launcher(output: str) -> list[str]:
    return ["-m", "prefix_sidecar_tools.bench.soak", "--traced-serve", output]


def _traced_serve(output: str, serve_argv: list[str]) -> int:
    """Child entry for --tracemalloc: run `serve` under tracemalloc; SIGUSR1 dumps the top
    allocation sites to `output`."""
    import tracemalloc

    tracemalloc.start(8)

    def dump(_signum: int, _frame: object) -> None:
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)]
        )
        lines = [f"traced total {tracemalloc.get_traced_memory()[0] / MB:.1f} MB"]
        for stat in snapshot.statistics("lineno")[:25]:
            lines.append(f"{stat.size / MB:8.2f} MB {stat.count:8d} blocks  {stat.traceback[0]}")
        lines.append("-- top 3 by traceback --")
        for stat in snapshot.statistics("traceback")[:3]:
            lines.append(f"{stat.size / MB:.2f} MB in {stat.count} blocks:")
            lines.extend("    " + line for line in stat.traceback.format())
        Path(output).write_text("\n".join(lines) + "\n", encoding="utf-8")

    signal.signal(signal.SIGUSR1, dump)
    from prefix_sidecar.cli import main

    return main(serve_argv)


# --- the load ------------------------------------------------------------------------------


@dataclass
class SoakOptions:
    concurrency: int = 1000
    seconds: float = 30.0
    warmup: float | None = None  # default: a third of the run, at most 10 s
    max_requests: int = 0  # 0: bounded by time only
    pods: int = 3
    time_scale: float = 200.0
    max_tokens: int = 16
    hold_s: float | None = None  # default: 2 s, or 20 s with prefixes (see hold below)
    prefixes: int = 0
    prefix_tokens: int = 60_000
    deadline_s: float = 60.0
    channels: int = 8
    sample_every_s: float = 0.25
    tracemalloc: str = ""

    @property
    def hold(self) -> float:
        """Seconds each pod holds a request before its first token. With 60k-token prefixes
        the emulated pods spend CPU parsing every 240 KB prompt, so 1,000 streams need a
        longer hold to stay within what the pods can parse (docs/benchmarks.md)."""
        if self.hold_s is not None:
            return self.hold_s
        return 20.0 if self.prefixes else 2.0

    @property
    def ramp_s(self) -> float:
        """Workers start spread over one hold period: 1,000 prompts landing on the pods in
        the same instant would be a thundering herd no real caller fleet produces."""
        return min(self.hold, self.seconds / 4)

    @property
    def warmup_s(self) -> float:
        if self.warmup is not None:
            return self.warmup
        return min(min(self.seconds / 3, 10.0) + self.ramp_s, self.seconds * 0.6)


@dataclass
class Sample:
    t: float
    rss: int
    fds: int
    open_streams: int


@dataclass
class LoadTally:
    issued: int = 0
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    open_streams: int = 0


def prefix_text(index: int, tokens: int) -> str:
    """A distinct, deterministic prefix of ~tokens tokens (its first bytes differ, so the
    route keys differ)."""
    head = f"soak prefix {index:04d}: platform rules, commission table and banned words.\n"
    body = "rule %d: a discount stacks with at most one cross-store coupon.\n"
    text, line = [head], 0
    size = len(head)
    while size < tokens * BYTES_PER_TOKEN:
        piece = body % line
        text.append(piece)
        size += len(piece)
        line += 1
    return "".join(text)[: tokens * BYTES_PER_TOKEN]


async def _register_prefixes(stub: Any, options: SoakOptions) -> None:
    from prefix_sidecar.v1 import router_pb2

    for index in range(options.prefixes):
        await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(
                name=f"soak-{index}", text=prefix_text(index, options.prefix_tokens)
            ),
            timeout=30,
        )


def _request_factory(options: SoakOptions) -> Callable[[int], Any]:
    from prefix_sidecar.v1 import router_pb2

    def make(number: int) -> Any:
        query = f"merchant {number}: a 2-for-15%-off script for this 499 yuan down jacket"
        if options.prefixes:
            return router_pb2.CompleteRequest(
                prefix_name=f"soak-{number % options.prefixes}",
                input=query,
                max_tokens=options.max_tokens,
                temperature=0.0,
            )
        # No prefixes: 16 shared "topics" so the routing keys spread over the pods.
        return router_pb2.CompleteRequest(
            input=f"topic {number % 16}: {'compliance rules ' * 20}\n{query}",
            max_tokens=options.max_tokens,
            temperature=0.0,
        )

    return make


async def _worker(
    stubs: list[Any],
    make: Callable[[int], Any],
    tally: LoadTally,
    options: SoakOptions,
    end: float,
    start_after: float,
) -> None:
    import grpc

    await asyncio.sleep(start_after)
    while time.monotonic() < end and not (
        options.max_requests and tally.issued >= options.max_requests
    ):
        number = tally.issued
        tally.issued += 1
        stub = stubs[number % len(stubs)]
        started = time.perf_counter()
        first = True
        finished = False
        tally.open_streams += 1
        try:
            async for chunk in stub.Complete(make(number), timeout=options.deadline_s):
                if first:
                    tally.ttfts.append(time.perf_counter() - started)
                    first = False
                finished = finished or bool(chunk.finish_reason)
            if finished:
                tally.ok += 1
            else:
                tally.errors["NO_FINISH_REASON"] += 1
        except grpc.aio.AioRpcError as exc:
            tally.errors[exc.code().name] += 1
            if len(tally.error_samples) < 5:
                tally.error_samples.append(f"{exc.code().name}: {exc.details()}")
        finally:
            tally.open_streams -= 1


async def _sample(pid: int, tally: LoadTally, samples: list[Sample], every: float) -> None:
    start = time.monotonic()
    while True:
        samples.append(
            Sample(time.monotonic() - start, rss_bytes(pid), fd_count(pid), tally.open_streams)
        )
        await asyncio.sleep(every)


async def _wait_all_serving(stub: Any, count: int, timeout: float = 30.0) -> None:
    from prefix_sidecar.v1 import router_pb2

    deadline = time.monotonic() + timeout
    while True:
        reply = await stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5)
        states = [b.state for b in reply.backends]
        if len(states) == count and all(s == "serving" for s in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"pods not all serving after {timeout} s: {states}")
        await asyncio.sleep(0.05)


async def _dump_traces(
    sidecar: SidecarProcess, output: str, after_s: float, timeout: float = 60.0
) -> None:
    """After `after_s`, ask the traced sidecar for its allocation sites; wait for the file."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(output)
    await asyncio.sleep(after_s)
    sidecar.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while not os.path.exists(output) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


def _window(samples: list[Sample], lo: float, hi: float) -> list[Sample]:
    return [s for s in samples if lo <= s.t <= hi] or samples[-1:]


async def run_soak(options: SoakOptions, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the whole soak and return the report (see the module docstring)."""
    import grpc

    from prefix_sidecar.v1 import router_pb2_grpc
    from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet

    # The pods hold each request `hold` s before its first token (a modelled prefill
    # overhead, run in parallel slots), so 1,000 streams are really open at once without
    # the pods burning CPU; everything else runs `time_scale` times faster than real.
    pod_config = EmulatorConfig(
        time_scale=options.time_scale,
        max_running=max(64, options.concurrency),
        prefill_slots=max(1, options.concurrency),
        prefill_overhead_s=options.hold * options.time_scale,
        kv_tokens=max(400_000, 2 * options.prefixes * options.prefix_tokens // options.pods),
    )
    workdir = tempfile.mkdtemp(prefix="soak-")
    progress(f"starting {options.pods} emulated pods (time scale {options.time_scale:g})")
    async with EmulatorFleet(options.pods, pod_config) as fleet:
        serve_args = [arg for url in fleet.urls for arg in ("--backend", url)]
        serve_args += ["--set", "log_level=warning", "--set", "health_interval_s=1.0"]
        serve_args += ["--set", f"max_prefixes={max(1024, options.prefixes)}"]
        serve_args += ["--set", f"max_prefix_bytes={max(4 * MB, options.prefix_tokens * 5)}"]
        sidecar = SidecarProcess(
            os.path.join(workdir, "s.sock"),
            serve_args,
            log_path=os.path.join(workdir, "sidecar.log"),
            launcher=_traced_launcher(options.tracemalloc) if options.tracemalloc else SERVE,
        )
        async with sidecar:
            pid = sidecar.pid
            channels = [
                grpc.aio.insecure_channel(
                    sidecar.target, options=[("grpc.use_local_subchannel_pool", 1)]
                )
                for _ in range(max(1, options.channels))
            ]
            try:
                stubs = [router_pb2_grpc.RouterStub(c) for c in channels]
                await _wait_all_serving(stubs[0], options.pods)
                await asyncio.sleep(0.5)
                idle_rss, idle_fds = rss_bytes(pid), fd_count(pid)
                progress(f"sidecar pid {pid} idle: RSS {idle_rss / MB:.1f} MB, {idle_fds} fds")
                if options.prefixes:
                    progress(
                        f"registering {options.prefixes} prefixes of {options.prefix_tokens} tokens"
                    )
                    await _register_prefixes(stubs[0], options)
                registered_rss = rss_bytes(pid)
                tally, samples = LoadTally(), list[Sample]()
                sampler = asyncio.create_task(_sample(pid, tally, samples, options.sample_every_s))
                progress(
                    f"load: {options.concurrency} concurrent streams for {options.seconds:g} s "
                    f"(warm-up {options.warmup_s:g} s)"
                )
                make = _request_factory(options)
                started = time.monotonic()
                end = started + options.seconds
                tracer = None
                if options.tracemalloc:  # where the memory is while the streams are open
                    tracer = asyncio.create_task(
                        _dump_traces(sidecar, options.tracemalloc, options.seconds * 0.75)
                    )
                await asyncio.gather(
                    *(
                        _worker(
                            stubs,
                            make,
                            tally,
                            options,
                            end,
                            n * options.ramp_s / options.concurrency,
                        )
                        for n in range(options.concurrency)
                    )
                )
                elapsed = time.monotonic() - started
                sampler.cancel()
                if tracer is not None:
                    await tracer
                await asyncio.sleep(1.0)
                after_rss, after_fds = rss_bytes(pid), fd_count(pid)
                breakdown = memory_breakdown(pid)
            finally:
                for channel in channels:
                    await channel.close()
    return _report(
        options,
        tally,
        samples,
        elapsed,
        idle=(idle_rss, idle_fds),
        registered_rss=registered_rss,
        after=(after_rss, after_fds),
        breakdown=breakdown,
    )


def _report(
    options: SoakOptions,
    tally: LoadTally,
    samples: list[Sample],
    elapsed: float,
    *,
    idle: tuple[int, int],
    registered_rss: int,
    after: tuple[int, int],
    breakdown: dict[str, float],
) -> dict[str, Any]:
    warm = options.warmup_s
    tail = max(options.sample_every_s * 2, (options.seconds - warm) / 5)
    start_window = _window(samples, warm, warm + tail)
    end_window = _window(samples, options.seconds - tail, options.seconds)
    # Windows, not single samples: one sample can land on a GC pause or a burst of
    # connections; growth means the level itself moved.
    rss_start = max(s.rss for s in start_window)
    rss_end = max(s.rss for s in end_window)
    fds_start = max(s.fds for s in start_window)
    fds_end = max(s.fds for s in end_window)
    rss_max = max((s.rss for s in samples), default=0)
    growth_pct = 100.0 * (rss_end - rss_start) / rss_start if rss_start else math.nan
    errors = sum(tally.errors.values())
    checks: dict[str, bool] = {
        "errors_zero": errors == 0 and tally.ok > 0,
        "rss_growth_within_5pct": growth_pct <= RSS_GROWTH_LIMIT_PCT,
        "fds_do_not_grow": fds_end <= fds_start * (1 + FD_JITTER),
    }
    if not options.tracemalloc:  # tracemalloc's own bookkeeping inflates RSS
        checks["idle_rss_within_80mb"] = idle[0] / MB <= IDLE_RSS_LIMIT_MB
    if options.prefixes >= 100 and options.concurrency >= 1000 and not options.tracemalloc:
        checks["loaded_rss_within_150mb"] = rss_max / MB <= LOADED_RSS_LIMIT_MB
    return {
        "concurrency": options.concurrency,
        "seconds": round(elapsed, 2),
        "warmup_s": warm,
        "pods": options.pods,
        "prefixes": options.prefixes,
        "prefix_tokens": options.prefix_tokens if options.prefixes else 0,
        "requests": tally.ok + errors,
        "requests_per_s": round((tally.ok + errors) / elapsed, 1) if elapsed else 0.0,
        "ok": tally.ok,
        "errors": errors,
        "errors_by_status": dict(tally.errors),
        "error_samples": tally.error_samples,
        "ttft_p50_ms": round(percentile(tally.ttfts, 50) * 1e3, 1),
        "ttft_p99_ms": round(percentile(tally.ttfts, 99) * 1e3, 1),
        "pod_hold_ms": round(options.hold * 1e3, 1),
        "max_open_streams": max((s.open_streams for s in samples), default=0),
        "rss_idle_mb": round(idle[0] / MB, 1),
        "rss_registered_mb": round(registered_rss / MB, 1),
        "rss_start_mb": round(rss_start / MB, 1),
        "rss_end_mb": round(rss_end / MB, 1),
        "rss_max_mb": round(rss_max / MB, 1),
        "rss_growth_pct": round(growth_pct, 2),
        "rss_after_load_mb": round(after[0] / MB, 1),
        "fds_idle": idle[1],
        "fds_start": fds_start,
        "fds_end": fds_end,
        "fds_after_load": after[1],
        "memory_after_load": breakdown,
        "tracemalloc_file": options.tracemalloc,
        "timeline": _timeline(samples),
        "checks": checks,
        "passed": all(checks.values()),
    }


def _timeline(samples: list[Sample], every_s: float = 1.0) -> list[list[float]]:
    """[t, RSS MB, fds, open streams] about once a second, to see a trend, not one point."""
    rows: list[list[float]] = []
    for sample in samples:
        if not rows or sample.t - rows[-1][0] >= every_s:
            rows.append(
                [round(sample.t, 1), round(sample.rss / MB, 1), sample.fds, sample.open_streams]
            )
    return rows


def render(report: dict[str, Any]) -> str:
    lines = [
        f"soak: {report['concurrency']} concurrent streams, {report['seconds']} s, "
        f"{report['pods']} pods, {report['prefixes']} prefixes",
        f"  requests      {report['requests']} ({report['requests_per_s']} req/s), "
        f"errors {report['errors']} {report['errors_by_status'] or ''}",
        f"  TTFT          p50 {report['ttft_p50_ms']} ms, p99 {report['ttft_p99_ms']} ms "
        f"(the pods hold each request {report['pod_hold_ms']} ms)",
        f"  RSS           idle {report['rss_idle_mb']} MB, registered "
        f"{report['rss_registered_mb']} MB, after warm-up {report['rss_start_mb']} MB -> end "
        f"{report['rss_end_mb']} MB ({report['rss_growth_pct']:+.2f} %), max "
        f"{report['rss_max_mb']} MB",
        f"  fds           idle {report['fds_idle']}, after warm-up {report['fds_start']} -> "
        f"end {report['fds_end']}, after load {report['fds_after_load']}",
    ]
    for sample in report["error_samples"]:
        lines.append(f"  error: {sample}")
    for name, passed in report["checks"].items():
        lines.append(f"  [{'ok' if passed else 'FAIL'}] {name}")
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------


SUMMARY = "N concurrent streams through a real sidecar process: errors, TTFT, RSS, fds"


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(bench_subparsers, "soak", SUMMARY, __doc__)
    defaults = SoakOptions()
    add = parser.add_argument
    add("--concurrency", type=positive_int, default=defaults.concurrency)
    add("--seconds", type=positive_float, default=defaults.seconds)
    add(
        "--warmup",
        type=float,
        help="seconds before RSS/fds are compared (default: the ramp-up + S/3, at most 10 s)",
    )
    add("--max-requests", type=int, default=0, help="stop after this many requests (0: none)")
    add("--pods", type=positive_int, default=defaults.pods)
    add("--time-scale", type=positive_float, default=defaults.time_scale)
    add("--max-tokens", type=positive_int, default=defaults.max_tokens)
    add(
        "--hold",
        dest="hold_s",
        type=non_negative,
        help="real seconds each pod holds a request before its first token, so the streams "
        "overlap (default 2, or 20 with --prefixes; 0 = as fast as possible)",
    )
    add("--prefixes", type=int, default=0, help="register N prefixes first (footprint mode)")
    add("--prefix-tokens", type=positive_int, default=defaults.prefix_tokens)
    add(
        "--deadline",
        dest="deadline_s",
        type=positive_float,
        default=defaults.deadline_s,
        help="per request, s",
    )
    add("--channels", type=positive_int, default=defaults.channels)
    add("--tracemalloc", metavar="FILE", default="", help="trace the sidecar; top sites to FILE")
    add_json_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.warmup is not None and not 0 <= args.warmup < args.seconds:
        print("bench soak: --warmup must be >= 0 and shorter than --seconds", file=sys.stderr)
        return 2
    if args.prefixes < 0:
        print("bench soak: --prefixes must be >= 0", file=sys.stderr)
        return 2
    # Each flag's dest is its option's name.
    options = SoakOptions(
        **{f.name: getattr(args, f.name) for f in fields(SoakOptions) if hasattr(args, f.name)}
    )
    if options.tracemalloc:
        options.tracemalloc = os.path.abspath(options.tracemalloc)

    report = run_and_report(
        "bench soak", run_soak(options, progress_printer("bench soak")), render, args.json
    )
    if report is None:
        return 130
    if options.tracemalloc and os.path.exists(options.tracemalloc):
        print(Path(options.tracemalloc).read_text(encoding="utf-8"), file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--traced-serve":
        sys.exit(_traced_serve(sys.argv[2], sys.argv[3:]))
    sys.exit("usage: prefix-sidecar bench soak --help")
