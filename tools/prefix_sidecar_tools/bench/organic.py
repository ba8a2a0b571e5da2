"""`prefix-sidecar bench organic`: routing prompts nobody registered, against the oracle ceiling.

One emulated fleet, one seeded organic trace (organic_trace: tenants' system prompts of
300-3,000 bytes with Zipf popularity, multi-turn sessions, few-shot templates), replayed
unchanged through each path (gRPC Complete with the raw prompt, gRPC Chat with messages,
the OpenAI HTTP front's /v1/completions and /v1/chat/completions) under each policy:
- round_robin: a sidecar with policy round_robin;
- window / window_xK: today's key, the prompt's first 4,096 bytes (or the Chat RPC's first
  message), with 1 and with K sidecar processes;
- radix: a central router with one shared approximate radix tree like SGLang's
  cache_aware (organic_radix), routing in this process and posting straight to the pods;
- radix_xK: K replicas of that router, each with its own tree and in-flight counts, each
  request to one drawn at random as for sidecar_xK: a central router scaled out (or made
  highly available) without sharing its state;
- sidecar / sidecar_xK: the sidecar's own default for unregistered prompts, 1 and K;
- hashed / hashed_xK (only when --policies names it): organic routing with flow starts
  sent to their session's pod like later turns (organic_balance_starts off), the scheme
  before starts were balanced: a before/after on the same pods, so the same ring;
- wide / wide_xK (only when --policies names it): organic routing with the spreads before
  sessions got a narrower set than starts (home spread 3, sessions over the whole home
  set): a before/after on the same pods;
- unfollowed / unfollowed_xK (only when --policies names it): organic routing without
  session follow (organic_follow_sessions off): every later turn to its session's pod;
- requests / requests_xK (only when --policies names it): organic routing with bounded load
  counting requests in flight (load_unit requests), the default's before/after;
- precise / precise_xK (only when --policies names it): unregistered_routing precise, each
  sidecar following every pod's KV events (the pods publish them in every run then);
- indexed / indexed_xK (only when --policies names it): precise on the shared index, a
  redis-server and a `kv-indexer` started for the run, the sidecars with kv_index_url;
- sglang / sglang_xK (only when --policies names it): SGLang's own router, cache_aware, a
  process each (organic_sglang), with the radix baseline's tree size and eviction.
With --pin-flows every request of a flow goes through one sidecar (radix replica) of the
_xK runs instead of one drawn per request.
Every run starts with the pods' caches emptied. The oracle (organic_oracle) gives the hit
rate of one infinite cache over the same trace; every policy is reported as a fraction of
it, whole run and per class. Times are modelled (the emulator's clock = real x
--time-scale). Definitions: docs/benchmarks.md, "Organic traffic".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import sys
import tempfile
import time
from collections.abc import Collection
from typing import Any

import aiohttp
import grpc

from prefix_sidecar_tools.bench.argtypes import non_negative, positive_float, positive_int
from prefix_sidecar_tools.bench.organic_driver import (
    PATHS,
    InFlightSampler,
    SidecarGroup,
    bucket_percentile,
    central_sender,
    decision_buckets,
    grpc_sender,
    http_front_sender,
    pod_requests,
    replay,
    scrape_sidecars,
    summed_by,
)
from prefix_sidecar_tools.bench.organic_oracle import Ceiling, oracle
from prefix_sidecar_tools.bench.organic_radix import CacheAwareRouter
from prefix_sidecar_tools.bench.organic_report import exact_decision_us, render, summarize
from prefix_sidecar_tools.bench.organic_seeds import render_pooled, run_seeds, seed_list
from prefix_sidecar_tools.bench.organic_sglang import sglang_senders
from prefix_sidecar_tools.bench.organic_targets import evaluate_targets
from prefix_sidecar_tools.bench.organic_trace import CLASSES, OrganicTrace, TraceParams, build_trace
from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet, reset_cache
from prefix_sidecar_tools.redis_server import shared_index
from prefix_sidecar_tools.report import (
    add_command,
    add_json_option,
    progress_printer,
    run_and_report,
)
from prefix_sidecar_tools.workload.driver import CHANNEL_OPTIONS

SCHEME_SETTING = "unregistered_routing"  # the routing helper's flag; "window" = today's key
RADIX_EVICTION_INTERVAL_S = 1.0  # real seconds; sgl-router's default is 120
# Central routers run only when named, after the sidecars: SGLang's own router.
OPTIONAL_CENTRAL = ("sglang",)
# The central routers take the same HTTP body on the gRPC path as on the HTTP path of the
# same body: that run is shown under both.
RADIX_TWIN = {"http-complete": "grpc-complete", "http-chat": "grpc-chat"}


def scheme_flag_exists() -> bool:
    from prefix_sidecar.config import Config

    return SCHEME_SETTING in {f.name for f in dataclasses.fields(Config)}


def sidecar_default_scheme() -> str:
    from prefix_sidecar.config import Config

    if not scheme_flag_exists():
        return f"window (this build has no {SCHEME_SETTING} setting: the window IS the default)"
    return str(getattr(Config(), SCHEME_SETTING))


# Organic routing's befores, each run only when named, on the same pods as "sidecar":
OPTIONAL_POLICIES: dict[str, dict[str, object]] = {
    # flow starts sent to their session's pod like later turns
    "hashed": {"organic_balance_starts": False},
    # the spreads before sessions got a narrower set than starts
    "wide": {"organic_home_spread": 3.0, "organic_session_spread": 3.0},
    # every later turn to its session's pod (no session follow, contract 9h)
    "unfollowed": {"organic_follow_sessions": False},
    # bounded load counting requests in flight, not their uncached tokens (issue 30)
    "requests": {"load_unit": "requests"},
    # organic, then the pod the KV events say holds the most of the prompt (the pods
    # publish events for these runs)
    "precise": {"unregistered_routing": "precise", "kv_events": True},
    # precise on the shared index: a redis-server and a kv-indexer per run, no
    # subscriptions in the sidecars (kv_index_url)
    "indexed": {"unregistered_routing": "precise"},
}


def policy_names(sidecars: int, with_scheme: bool, optional: Collection[str] = ()) -> list[str]:
    """The runs, in order: the default policies, then the OPTIONAL_POLICIES named."""
    names = ["round_robin", "window", f"window_x{sidecars}", "radix", f"radix_x{sidecars}"]
    if with_scheme:
        names += ["sidecar", f"sidecar_x{sidecars}"]
        for name in OPTIONAL_POLICIES:
            if name in optional:
                names += [name, f"{name}_x{sidecars}"]
    for name in OPTIONAL_CENTRAL:
        if name in optional:
            names += [name, f"{name}_x{sidecars}"]
    return names


def previous_turns(trace: OrganicTrace) -> list[int]:
    """For each request, the seq of its flow's previous turn (-1 for a first turn)."""
    before = [-1] * len(trace.requests)
    for flow in trace.flows:
        for earlier, later in zip(flow.requests, flow.requests[1:], strict=False):
            before[later.seq] = earlier.seq
    return before


def pod_config(args: argparse.Namespace) -> EmulatorConfig:
    precise = {"precise", "indexed"} & set((args.policies or "").split(","))
    return EmulatorConfig(
        time_scale=args.time_scale,
        kv_tokens=args.kv_tokens,
        prefill_tps=args.prefill_tps,
        max_running=64,
        kv_events="map" if precise else "off",
    )


async def run_one(
    path: str,
    name: str,
    args: argparse.Namespace,
    urls: list[str],
    trace: OrganicTrace,
    ceilings: list[Ceiling],
    session: aiohttp.ClientSession,
    socket_dir: str,
) -> dict[str, Any]:
    """One (path, policy) run on a fleet whose caches are emptied first."""
    await asyncio.gather(*(reset_cache(url) for url in urls))
    chat = path.endswith("chat")
    timeout_s = args.first_token_timeout / args.time_scale
    before = await pod_requests(session, urls)
    sampler = InFlightSampler(session, urls)
    started = time.perf_counter()
    organic_kinds: dict[str, float] = {}
    picks: dict[str, float] = {}  # the sidecars' bounded-load branches (home, spill, ...)
    failovers: dict[str, float] = {}  # attempts moved to the next pod, by reason
    precise: dict[str, float] = {}  # precise routing's outcomes
    tree_chars = args.radix_tree_chars or 4 * args.kv_tokens
    if name.startswith("sglang"):
        replicas = int(name.partition("_x")[2] or 1)
        async with sglang_senders(
            session,
            urls,
            replicas,
            tree_chars,
            RADIX_EVICTION_INTERVAL_S,
            pod_config(args).model,
            chat=chat,
            max_tokens=args.max_tokens,
            first_token_timeout_s=timeout_s,
            pin_flows=args.pin_flows,
        ) as send:
            with sampler:
                results = await replay(trace, send, args.time_scale)
        for result in results:  # the router does not say which pod answered
            result.backend = ""
        decision = {"p50": math.nan, "p99": math.nan, "bucketed": False}
        sidecars = 0
    elif name.startswith("radix"):
        replicas = int(name.partition("_x")[2] or 1)
        routers = [
            CacheAwareRouter(
                urls,
                max_tree_chars=tree_chars,
                eviction_interval_s=RADIX_EVICTION_INTERVAL_S,
            )
            for _ in range(replicas)
        ]
        samples: list[int] = []
        send = central_sender(
            session, routers, chat, args.max_tokens, timeout_s, samples, args.pin_flows
        )
        with sampler:
            results = await replay(trace, send, args.time_scale)
        decision = exact_decision_us(samples)
        sidecars = 0
    else:
        policy, _, count = name.partition("_x")
        sidecars = int(count) if count else 1
        settings: dict[str, object] = {}
        if policy == "round_robin":
            settings["policy"] = "round_robin"
        elif policy == "window" and scheme_flag_exists():
            settings[SCHEME_SETTING] = "window"
        elif policy in OPTIONAL_POLICIES:
            settings.update(OPTIONAL_POLICIES[policy])
        async with contextlib.AsyncExitStack() as stack:
            if policy == "indexed":
                settings["kv_index_url"] = await stack.enter_async_context(shared_index(urls))
            group = SidecarGroup(
                sidecars, urls, settings, socket_dir=socket_dir, http_front=path.startswith("http")
            )
            await stack.enter_async_context(group)
            if path.startswith("grpc"):
                channels = [
                    grpc.aio.insecure_channel(t, options=CHANNEL_OPTIONS) for t in group.targets
                ]
                try:
                    send = grpc_sender(channels, path, args.max_tokens, timeout_s, args.pin_flows)
                    with sampler:
                        results = await replay(trace, send, args.time_scale)
                finally:
                    for channel in channels:
                        await channel.close()
            else:
                send = http_front_sender(
                    session, group.http_urls, chat, args.max_tokens, timeout_s, args.pin_flows
                )
                with sampler:
                    results = await replay(trace, send, args.time_scale)
            scraped = await scrape_sidecars(session, group.metrics_ports)
        buckets = decision_buckets(scraped)
        # how each organic decision went (none for the window and round-robin)
        organic_kinds = summed_by(scraped, "prefix_sidecar_organic_decisions_total", "kind")
        picks = summed_by(scraped, "prefix_sidecar_requests_total", "branch")
        failovers = summed_by(scraped, "prefix_sidecar_failovers_total", "reason")
        precise = summed_by(scraped, "prefix_sidecar_precise_decisions_total", "outcome")
        decision = {
            "p50": bucket_percentile(buckets, 50) * 1e6,
            "p99": bucket_percentile(buckets, 99) * 1e6,
            "bucketed": True,
            "top_bucket_us": max((b for b in buckets if math.isfinite(b)), default=0.0) * 1e6,
        }
    after = await pod_requests(session, urls)
    summary = summarize(
        results,
        ceilings,
        time_scale=args.time_scale,
        timeout_s=timeout_s,
        pod_requests={url: after[url] - before[url] for url in urls},
        in_flight=sampler.means(),
        decision_us=decision,
        previous_turn=previous_turns(trace),
        warmup_s=max(args.warmup, args.measure_after),
        counted=counted_requests(trace, args.measure_after),
    )
    summary["sidecars"] = sidecars
    if organic_kinds:  # the sidecars' own counts, whole run (warm-up included)
        summary["organic_decisions"] = {k: int(v) for k, v in organic_kinds.items()}
        summary["picks"] = {k: int(v) for k, v in picks.items()}
        summary["failovers"] = {k: int(v) for k, v in failovers.items()}
        summary["precise"] = {k: int(v) for k, v in precise.items()}
    summary["wall_s"] = time.perf_counter() - started
    return summary


async def run_bench(args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    started = time.perf_counter()
    trace = build_trace(TraceParams.of_settings(vars(args)))
    ceilings = oracle([r.prompt for r in trace.requests])
    with_scheme = scheme_flag_exists()
    wanted = args.policies.split(",") if args.policies else []
    names = policy_names(args.sidecars, with_scheme, wanted)
    if wanted:
        names = [n for n in names if n.partition("_x")[0] in wanted]
    paths = args.paths.split(",") if args.paths else list(PATHS)
    runs: dict[str, dict[str, Any]] = {}
    progress(
        f"{len(trace.requests)} requests in {len(trace.flows)} flows; "
        f"{len(paths)} paths x {len(names)} policies"
    )
    async with (
        EmulatorFleet(args.pods, pod_config(args)) as fleet,
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        ) as session,
    ):
        with tempfile.TemporaryDirectory(prefix="prefix-sidecar-organic-") as socket_dir:
            for path in paths:
                runs[path] = {}
                for name in names:
                    twin = RADIX_TWIN.get(path)
                    central = name.startswith(("radix", *OPTIONAL_CENTRAL))
                    if central and twin in runs and name in runs[twin]:
                        # No sidecar, no front: the same run as on the twin path (same body).
                        runs[path][name] = {**runs[twin][name], "same_run_as": twin}
                        continue
                    r = await run_one(
                        path, name, args, fleet.urls, trace, ceilings, session, socket_dir
                    )
                    runs[path][name] = r
                    progress(
                        f"{path:<14}{name:<14} hit {r['hit_rate']:.4f} ({r['fraction']:.3f} of "
                        f"ceiling)  p99 {r['ttft_ms']['p99']:,.0f} ms  max/mean "
                        f"{r['load']['max_over_mean']:.2f}  errors {sum(r['errors'].values())}"
                        f"  ({r['wall_s']:.0f} s)"
                    )
                if not with_scheme:  # the default IS the window: same runs, named for targets
                    for name in list(runs[path]):
                        if name.startswith("window"):
                            runs[path][name.replace("window", "sidecar")] = runs[path][name]
    prompt = [c.prompt_tokens for c in ceilings]
    report: dict[str, Any] = {
        "params": {k: v for k, v in vars(args).items() if k not in ("func", "command")},
        "sidecar_scheme": sidecar_default_scheme(),
        "spread_over_sidecars": "at random per request (seeded by its sequence number)",
        "trace": {
            "requests": len(trace.requests),
            "flows": len(trace.flows),
            "classes": trace.counts(),
            "prompt_tokens": sum(prompt),
        },
        "ceiling": _ceiling(trace, ceilings, args.measure_after),
        "paths": runs,
    }
    span = max(r.nominal_at for r in trace.requests)
    config = pod_config(args)
    prefill_s = sum(
        config.prefill_overhead_s + (c.prompt_tokens - c.cached_tokens) / config.prefill_tps
        for c in ceilings
    )
    report["utilisation_at_ceiling"] = prefill_s / (span * args.pods) if span > 0 else 0.0
    report["ttft_floor_ms"] = ttft_floor_ms(
        trace, ceilings, config, max(args.warmup, args.measure_after)
    )
    report["distinct_prompt_tokens"] = sum(c.prompt_tokens - c.cached_tokens for c in ceilings)
    report["targets"] = evaluate_targets(report)
    report["wall_s"] = time.perf_counter() - started
    return report


def ttft_floor_ms(
    trace: OrganicTrace, ceilings: list[Ceiling], config: EmulatorConfig, warmup_s: float
) -> dict[str, float]:
    """What no router can beat: the prefill time of each request timed after the warm-up if
    it got the ceiling's hits and waited for nothing (modelled ms; the first token's decode
    and the hops come on top). A policy already near it cannot be made much faster."""
    times = sorted(
        1000.0
        * (config.prefill_overhead_s + (c.prompt_tokens - c.cached_tokens) / config.prefill_tps)
        for c, r in zip(ceilings, trace.requests, strict=True)
        if r.nominal_at >= warmup_s
    )
    if not times:
        return {"p50": 0.0, "p99": 0.0}
    return {
        "p50": times[math.ceil(0.50 * len(times)) - 1],
        "p99": times[math.ceil(0.99 * len(times)) - 1],
    }


def counted_requests(trace: OrganicTrace, measure_after: float) -> list[bool] | None:
    """Which requests are measured: those due at or after `measure_after` modelled seconds
    (by the trace's nominal times, so every policy counts the same ones); None: all."""
    if measure_after <= 0:
        return None
    return [r.nominal_at >= measure_after for r in trace.requests]


def _ceiling(trace: OrganicTrace, ceilings: list[Ceiling], measure_after: float) -> dict[str, Any]:
    """The oracle's hit rate over the measured requests, whole and per class."""
    keep = counted_requests(trace, measure_after)
    pairs = [
        (r, c)
        for i, (r, c) in enumerate(zip(trace.requests, ceilings, strict=True))
        if keep is None or keep[i]
    ]

    def rate(kind: str | None) -> float:
        mine = [c for r, c in pairs if kind is None or r.kind == kind]
        tokens = sum(c.prompt_tokens for c in mine)
        return sum(c.cached_tokens for c in mine) / tokens if tokens else 0.0

    return {"hit_rate": rate(None), "classes": {kind: rate(kind) for kind in CLASSES}}


SUMMARY = "unregistered organic traffic: every policy as a fraction of the oracle ceiling"


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(bench_subparsers, "organic", SUMMARY, __doc__)
    add = parser.add_argument
    add("--pods", type=positive_int, default=4)
    add(
        "--sidecars",
        type=positive_int,
        default=4,
        help="K, the sidecar processes of the _xK runs (default 4)",
    )
    add(
        "--kv-tokens",
        type=positive_int,
        default=12_000,
        help="KV cache of each pod, tokens (default %(default)s: the 4 pods together hold "
        "about two thirds of the trace's distinct prompt tokens, so placement matters)",
    )
    add(
        "--prefill-tps",
        type=positive_float,
        default=1_500.0,
        help="each pod's prefill tokens per modelled second (default %(default)s: slower "
        "than the fleet bench's pod, so that a moderate request rate loads it)",
    )
    add(
        "--time-scale",
        type=positive_float,
        default=6.0,
        help="modelled seconds per real second (default %(default)s)",
    )
    add(
        "--duration",
        type=positive_float,
        default=45.0,
        help="modelled seconds in which flows start (default %(default)s; sessions run on)",
    )
    add(
        "--warmup",
        type=non_negative,
        default=10.0,
        help="modelled seconds at the start left out of the TTFT percentiles (default "
        "%(default)s; hit rates and loads cover the whole run unless --measure-after)",
    )
    add(
        "--measure-after",
        type=non_negative,
        default=0.0,
        help="modelled seconds of traffic sent and cached but not measured: a steady "
        "state's warm-up (default %(default)s: the whole run, from empty caches and sidecars "
        "that have learnt nothing)",
    )
    add("--tenants", type=positive_int, default=24)
    add(
        "--templates",
        type=positive_int,
        default=6,
        help="few-shot templates (default %(default)s)",
    )
    add("--zipf", type=float, default=1.0, help="popularity exponent of tenants and templates")
    add(
        "--tenant-rate",
        type=non_negative,
        default=4.0,
        help="one-shot tenant requests per modelled second (default %(default)s)",
    )
    add(
        "--fewshot-rate",
        type=non_negative,
        default=3.0,
        help="few-shot requests per modelled second (default %(default)s)",
    )
    add(
        "--session-rate",
        type=non_negative,
        default=0.7,
        help="sessions started per modelled second, 4-10 turns each (default %(default)s)",
    )
    add(
        "--max-tokens",
        type=positive_int,
        default=4,
        help="tokens each answer streams (the next turn's answer text is the trace's own)",
    )
    add(
        "--first-token-timeout",
        type=positive_float,
        default=30.0,
        help="modelled seconds a caller waits for the first token",
    )
    add(
        "--pin-flows",
        action="store_true",
        help="send every request of a flow through one sidecar (radix replica) of the _xK "
        "runs: a sidecar per caller, a conversation kept on one caller (default: each "
        "request to one drawn at random)",
    )
    add("--paths", help=f"comma-separated subset of {', '.join(PATHS)} (default all)")
    add(
        "--policies",
        help="comma-separated subset of round_robin, window, radix, sidecar (default all "
        "four), and, only when named: hashed (organic_balance_starts off), wide (home "
        "spread 3, sessions over the whole home set), unfollowed (organic_follow_sessions "
        "off), requests (load_unit requests), precise, indexed, sglang (SGLang's router)",
    )
    add(
        "--radix-tree-chars",
        type=positive_int,
        default=None,
        help="the radix baseline's per-worker tree size, characters (default 4 x "
        "--kv-tokens: what a pod's KV holds)",
    )
    add("--seed", type=int, default=0)
    add(
        "--seeds",
        type=seed_list,
        help="run the whole bench once per seed ('0,1,2' or '0-5') and pool every seed's "
        "measured TTFTs: a p99 over the slowest 5 x K requests of K traces, not one trace's 5",
    )
    add("--quick", action="store_true", help="seconds per run, for tests: 2 pods, 2 sidecars")
    add_json_option(parser)
    parser.set_defaults(func=run)


def _apply_quick(args: argparse.Namespace) -> None:
    args.pods, args.sidecars = 2, 2
    args.duration, args.time_scale, args.warmup = 6.0, 20.0, 1.0
    args.tenants, args.templates = 6, 3


def run(args: argparse.Namespace) -> int:
    if args.quick:
        _apply_quick(args)
    paths = args.paths.split(",") if args.paths else []
    unknown = set(paths) - set(PATHS)
    if unknown:
        print(
            f"prefix-sidecar bench organic: --paths has {', '.join(sorted(unknown))}; "
            f"choose from {', '.join(PATHS)}",
            file=sys.stderr,
        )
        return 2
    policies = {"round_robin", "window", "radix", "sidecar", *OPTIONAL_POLICIES, *OPTIONAL_CENTRAL}
    unknown = set((args.policies or "").split(",")) - policies - {""}
    if unknown:
        print(
            f"prefix-sidecar bench organic: --policies has {', '.join(sorted(unknown))}; "
            f"choose from {', '.join(sorted(policies))}",
            file=sys.stderr,
        )
        return 2
    if args.warmup >= args.duration:
        print("prefix-sidecar bench organic: --warmup must be < --duration", file=sys.stderr)
        return 2
    if args.measure_after >= args.duration:
        print(
            "prefix-sidecar bench organic: --measure-after must be < --duration (flows start "
            "within --duration)",
            file=sys.stderr,
        )
        return 2
    try:
        TraceParams(
            duration_s=args.duration,
            tenant_rate=args.tenant_rate,
            fewshot_rate=args.fewshot_rate,
            session_rate=args.session_rate,
        ).validate()
    except ValueError as exc:
        print(f"prefix-sidecar bench organic: {exc}", file=sys.stderr)
        return 2
    progress = progress_printer("bench organic")
    if args.seeds:
        measure = run_seeds(args, lambda one: run_bench(one, progress))
        report = run_and_report("bench organic", measure, render_pooled, args.json)
    else:
        report = run_and_report("bench organic", run_bench(args, progress), render, args.json)
    return 130 if report is None else 0
