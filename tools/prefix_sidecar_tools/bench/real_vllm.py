"""`bench real --engine vllm`: routing systems compared on one fleet of real vLLM pods.

One fleet (VllmFleet, the tiny model, one core per pod in turn), two workloads, every
system on each, the pods made cold between runs (restarted by default; with --cold reset,
vLLM's dev-mode POST /reset_prefix_cache, quicker and a little less honest: the pods keep
their warm processes):

  registered  the mega-sale: 4k-16k-token prefixes, thin queries, Poisson, Zipf (real_megasale)
  organic     `bench organic`'s trace: tenants' system prompts, multi-turn sessions, few-shot
              templates, nobody registered, replayed closed loop as that bench does

The pods' KV budget is a share (--kv-share) of all the prefixes' tokens, so the prefixes
cannot all fit in one pod: a router that sends a prefix everywhere evicts. Latency is
meaningful with one pod per core (2 on a 2-core box), routing quality with more pods.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.tokenize import token_ids
from prefix_sidecar_tools.bench.organic_driver import Result, replay
from prefix_sidecar_tools.bench.organic_trace import OrganicTrace, TraceParams
from prefix_sidecar_tools.bench.organic_trace import build_trace as build_organic
from prefix_sidecar_tools.bench.real_megasale import (
    Ceiling,
    MegasaleParams,
    Prefix,
    build_prefixes,
    build_trace,
    ceiling,
    kv_tokens_for,
    organic_ceiling,
    target_sizes,
)
from prefix_sidecar_tools.bench.real_report import per_request, scrape, summarize
from prefix_sidecar_tools.bench.real_systems import READ_EVENTS, SYSTEMS, Setup
from prefix_sidecar_tools.vllm.fleet import (
    DEFAULT_BLOCK_SIZE,
    VllmFleet,
    ensure_tiny_model,
    require_vllm_python,
)

KV_BYTES_PER_TOKEN = 2048  # the tiny model's fp32 KV: 2 layers x K,V x 4 heads x 32 x 4 bytes
WORKLOADS = ("registered", "organic")
COLD = ("restart", "reset")
DEV_MODE = "VLLM_SERVER_DEV_MODE"  # vLLM serves /reset_prefix_cache only with this set
ORGANIC_MAX_TOKENS = 16384  # room for the organic trace's longest session


def organic_params(args: argparse.Namespace) -> TraceParams:
    """`bench organic`'s trace, shortened to fit a real fleet's run: fewer seconds of
    arrivals, shorter sessions with shorter pauses."""
    return TraceParams(
        seed=args.seed,
        duration_s=args.organic_duration,
        tenant_rate=args.organic_rate * 0.5,
        fewshot_rate=args.organic_rate * 0.35,
        session_rate=args.organic_rate * 0.15 / 3,
        min_turns=2,
        max_turns=4,
        min_gap_s=0.5,
        max_gap_s=2.0,
    )


async def make_cold(fleet: VllmFleet, session: aiohttp.ClientSession, how: str) -> None:
    """Every pod's prefix cache emptied: the same processes reset, or new ones started on the
    same ports (so the routing, by URL, is unchanged)."""
    if how == "reset":
        for url in fleet.urls:
            async with session.post(f"{url}/reset_prefix_cache") as response:
                response.raise_for_status()
        return
    for pod in fleet.pods:
        await pod.stop()
    for pod in fleet.pods:
        await pod.start(fleet.server_argv(pod.port))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as probe:
        for pod in fleet.pods:
            await pod.wait_ready(probe, fleet.startup_timeout)


async def run_system(
    name: str, setup: Setup, trace: OrganicTrace, time_scale: float, found: Ceiling | None
) -> tuple[list[Result], dict[str, Any]]:
    """One system on one workload: counters before, the replay, counters after; the row
    has the workload's whole-block ceiling (`found`, the organic one; the registered one is
    worked out over the answered requests)."""
    urls = setup.fleet.urls
    before = await scrape(setup.session, urls)
    started = time.perf_counter()
    async with SYSTEMS[name](setup) as send:
        results = await replay(trace, send, time_scale)
    elapsed = time.perf_counter() - started
    after = await scrape(setup.session, urls)
    if setup.prefixes:
        found = ceiling(trace, results, setup.prefixes, setup.fleet.block_size)
    row = summarize(results, before, after, elapsed, found)
    return results, {**row, **setup.notes}


async def bench_vllm(args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    params = MegasaleParams(
        seed=args.seed,
        prefixes=args.prefixes,
        min_tokens=args.min_prefix_tokens,
        max_tokens=args.max_prefix_tokens,
        requests=args.requests,
        rate=args.rate,
        zipf=args.zipf,
    )
    params.validate()
    sizes = target_sizes(params)
    block = DEFAULT_BLOCK_SIZE
    kv_tokens = args.kv_tokens or kv_tokens_for(sizes, args.kv_share, block)
    # vLLM refuses to start unless one sequence of max_model_len fits with a block to spare
    max_model_len = min(kv_tokens - 2 * block, max(max(sizes) + 2 * block, ORGANIC_MAX_TOKENS))
    if args.cold == "reset":
        os.environ[DEV_MODE] = "1"  # the pods inherit it
    python = require_vllm_python()
    model = ensure_tiny_model(python)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="br-") as scratch:  # short: vLLM's ipc paths
        fleet = VllmFleet(
            model,
            args.pods,
            python=python,
            kv_cache_bytes=kv_tokens * KV_BYTES_PER_TOKEN,
            max_model_len=max_model_len,
            block_size=block,
            scratch=Path(scratch) / "f",
            startup_timeout=args.startup_timeout,
            kv_events=bool(set(READ_EVENTS) & set(args.systems)),
            nice=args.pods_nice,
        )
        timeout = aiohttp.ClientTimeout(total=args.timeout * 2)
        async with fleet, aiohttp.ClientSession(timeout=timeout) as session:
            progress(f"{args.pods} pods ready in {time.perf_counter() - started:.0f} s")
            prefixes = await build_prefixes(session, fleet.urls[0], fleet.model, params)
            workloads = _workloads(args, params, prefixes)
            report: dict[str, Any] = {
                "fleet": {
                    "pods": args.pods,
                    "urls": fleet.urls,  # a per-request row's pod index is into this list
                    "kv_tokens": kv_tokens,
                    "block_size": block,
                    "max_model_len": max_model_len,
                    "prefix_tokens": [p.tokens for p in prefixes],
                    "cold": args.cold,
                    "nice": args.pods_nice,
                },
                "settings": {k: v for k, v in vars(args).items() if k != "func"},
                "workloads": {},
                "requests": {},
            }
            ceilings = await _organic_ceiling(fleet, workloads)
            first = True
            for workload, (trace, scale) in workloads.items():
                rows: dict[str, Any] = report["workloads"].setdefault(workload, {})
                for name in args.systems:
                    if not first:
                        await make_cold(fleet, session, args.cold)
                    first = False
                    setup = Setup(
                        fleet,
                        prefixes if workload == "registered" else (),
                        session,
                        args.max_tokens,
                        args.timeout,
                        Path(scratch),
                        settings=tuple(args.sidecar_set),
                    )
                    found = ceilings.get(workload)
                    results, row = await run_system(name, setup, trace, scale, found)
                    rows[name] = row
                    report["requests"][f"{workload}/{name}"] = per_request(
                        results, [r.owner for r in trace.requests], fleet.urls
                    )
                    progress(
                        f"{workload} {name}: hit {row['hit_rate']:.3f}, TTFT p99 "
                        f"{row['ttft_p99_ms']:.0f} ms, {row['errors']} errors, "
                        f"{row['elapsed_s']:.0f} s"
                        + (f", re-prewarms {row['reprewarms']}" if "reprewarms" in row else "")
                    )
    report["elapsed_s"] = time.perf_counter() - started
    return report


async def _organic_ceiling(
    fleet: VllmFleet, workloads: dict[str, tuple[OrganicTrace, float]]
) -> dict[str, Ceiling]:
    """The organic trace's ceiling, its prompts tokenized by a pod (its own tokenizer)."""
    if "organic" not in workloads:
        return {}
    trace = workloads["organic"][0]
    async with UpstreamClient() as client:
        ids = [
            await token_ids(client, fleet.urls[0], r.prompt, model=fleet.model)
            for r in trace.requests
        ]
    return {"organic": organic_ceiling(ids, fleet.block_size)}


def _workloads(
    args: argparse.Namespace, params: MegasaleParams, prefixes: list[Prefix]
) -> dict[str, tuple[OrganicTrace, float]]:
    """Each chosen workload's trace and the time scale it is replayed at."""
    found: dict[str, tuple[OrganicTrace, float]] = {}
    if "registered" in args.workloads:
        found["registered"] = (build_trace(params, prefixes), 1.0)
    if "organic" in args.workloads:
        found["organic"] = (build_organic(organic_params(args)), 1.0)
    return found
