"""`prefix-sidecar demo`: a mega-sale in half a minute, on emulated pods, with no config.

It starts an emulated vLLM fleet and a sidecar on a temporary unix socket, registers the
mega-sale prefixes (a ~60k-token compliance-rules text, a live-stream script and category
annexes), prewarms them while printing every event as it arrives, replays a merchant
workload through the sidecar and then, after a cache reset, through round-robin on the same
fleet, and prints hit rate, TTFT, routing decision time and docs/mission.md's daily cost at the
measured hit rate. Everything it started is stopped on exit, Ctrl-C included.

Times are the emulator's modelled clock (real time x --time-scale). Answers are cut to
--max-tokens tokens but streamed at the pace of a 500-token answer, so pods and sidecar
see as many requests in flight as docs/mission.md's workload has, with few chunks to relay.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from typing import Any

from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.cost import CostParams, daily_cost
from prefix_sidecar_tools.emulator import EmulatorFleet
from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.report import add_command, add_json_option, run_and_report
from prefix_sidecar_tools.workload.scenario import PolicyRun, route_timings, run_policy
from prefix_sidecar_tools.workload.stats import summarize
from prefix_sidecar_tools.workload.trace import (
    mega_sale_pod,
    mega_sale_prefixes,
    poisson_trace,
    size_fleet,
)

STATE = router_pb2.PrewarmEvent.State


def _short(url: str) -> str:
    return url.removeprefix("http://")


class Printer:
    """Progress lines, flushed at once (the demo is watched live)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, text: str = "") -> None:
        if not self.quiet:
            print(text, flush=True)


def _prewarm_printer(out: Printer, time_scale: float) -> Any:
    def on_event(name: str, event: router_pb2.PrewarmEvent) -> None:
        state = STATE.Name(event.state)
        line = f"      {name:<34} -> {_short(event.backend):<17} {state:<8}"
        if event.state == STATE.WARMED:
            line += (
                f" {event.prompt_tokens:>6,} tokens prefilled in "
                f"{event.elapsed_ms * time_scale:>6,.0f} ms"
            )
        elif event.error:
            line += f" attempt {event.attempt}: {event.error}"
        out(line)

    return on_event


async def _demo(args: argparse.Namespace, out: Printer) -> dict[str, Any]:
    scale = args.time_scale
    config = mega_sale_pod(scale, args.kv_tokens, args.max_tokens)
    out(
        f"prefix-sidecar demo: {args.pods} emulated H100 pods, time x{scale:g} "
        "(all times below are modelled)"
    )
    started = time.perf_counter()
    async with EmulatorFleet(args.pods, config) as fleet:
        out(
            f"[1/4] fleet up in {time.perf_counter() - started:.1f} s: "
            + ", ".join(_short(u) for u in fleet.urls)
        )
        out(
            f"      each pod: KV {config.kv_tokens:,} tokens, prefill "
            f"{config.prefill_tps:,.0f} tok/s, one prefill at a time"
        )
        prefixes = mega_sale_prefixes(args.prefixes, seed=args.seed)
        sizing = size_fleet(config, prefixes, args.rate, args.pods, args.max_tokens)
        replicas, budget = sizing.replicas, sizing.budget
        trace = poisson_trace(prefixes, args.requests, args.rate, seed=args.seed)
        out(f"[2/4] mega-sale prefixes (replicas sized for {args.rate:g} req/s):")
        for prefix, count in zip(prefixes, replicas, strict=True):
            out(
                f"      {prefix.name:<34} {prefix.tokens:>6,} tokens  "
                f"{100 * prefix.weight:4.1f} % of requests  replicas {count}"
            )
        out(
            f"      sidecar KV budget: at most {budget:,} prefix tokens homed per pod "
            "(KV minus in-flight requests)"
        )
        out("      sidecar prewarm, live:")
        timeout_s = args.first_token_timeout / scale
        common: dict[str, Any] = {
            "time_scale": scale,
            "max_tokens": args.max_tokens,
            "first_token_timeout_s": timeout_s,
        }
        settings: dict[str, Any] = {"grace_s": 1, "health_interval_s": 0.2}
        timings: dict[str, list[float]] = {}

        async def measure_route(processes: Any, ids: list[str]) -> None:
            timings.update(await route_timings(processes.targets[0], ids[0], args.route_calls))

        example = trace[0].input.strip().split("\n")[0]
        runs: list[PolicyRun] = []
        for index, policy in enumerate(("prefix_affinity", "round_robin")):
            label = "sidecar (prefix_affinity)" if index == 0 else "round-robin (cache reset)"
            if index == 1:
                out(f"      {label}: cache reset, same prewarm, same trace ...")
            run = await run_policy(
                fleet.urls,
                policy,
                prefixes,
                replicas,
                trace,
                on_prewarm=_prewarm_printer(out, scale) if index == 0 else None,
                before_stop=measure_route if index == 0 else None,
                settings={**settings, "home_kv_budget_tokens": budget} if index == 0 else settings,
                **common,
            )
            runs.append(run)
            if index == 0:
                out(
                    f"[3/4] {len(trace)} merchant queries, Poisson {args.rate:g} req/s, "
                    f"e.g. {example[:90]!r}"
                )
            out(f"      {label:<28} done in {run.wall_s:.1f} s")
    tokens = [p.tokens for p in prefixes]
    results = {
        run.policy: summarize(
            run.outcomes,
            tokens,
            list(run.pod_requests),
            scale,
            first_token_timeout_s=timeout_s,
            loads=run.pod_requests,
        )
        for run in runs
    }
    cost = {
        policy: daily_cost(CostParams(), result["hit_rate"]).cached
        for policy, result in results.items()
    }
    return {
        "params": {k: v for k, v in vars(args).items() if k != "func"},
        "replicas": dict(zip([p.name for p in prefixes], replicas, strict=True)),
        "home_kv_budget_tokens": budget,
        "results": results,
        "route": {
            "calls": len(timings.get("decision_ns", [])),
            "decision_ns_p50": percentile(timings.get("decision_ns", []), 50),
            "decision_ns_p99": percentile(timings.get("decision_ns", []), 99),
            "round_trip_us_p50": percentile(timings.get("round_trip_ns", []), 50) / 1e3,
            "round_trip_us_p99": percentile(timings.get("round_trip_ns", []), 99) / 1e3,
        },
        "cost_yuan_per_day": {"raw": daily_cost(CostParams(), 0.0).raw, **cost},
        "wall_s": time.perf_counter() - started,
    }


def _ms(value: float, lower_bound: bool = False) -> str:
    if math.isnan(value):
        return "-"
    return (">" if lower_bound else "") + f"{value:,.0f} ms"


def render(report: dict[str, Any]) -> str:
    results = report["results"]
    lines = [
        "[4/4] summary (same fleet, same trace, same prewarm; only the routing differs)",
        f"      {'':<14}{'hit rate':>9}{'TTFT p50':>12}{'TTFT p99':>12}"
        f"{'max/mean load':>15}{'errors':>8}",
    ]
    labels = {"prefix_affinity": "sidecar", "round_robin": "round-robin"}
    for policy, label in labels.items():
        r = results[policy]
        ttft = r["ttft_ms"]
        lines.append(
            f"      {label:<14}{100 * r['hit_rate']:>8.1f}%{_ms(ttft['p50']):>12}"
            f"{_ms(ttft['p99'], ttft['lower_bound']):>12}"
            f"{r['load']['max_over_mean']:>15.2f}{sum(r['errors'].values()):>8}"
        )
    side, rr = results["prefix_affinity"]["ttft_ms"], results["round_robin"]["ttft_ms"]
    if side["p99"] > 0 and not math.isnan(rr["p99"]):
        lines.append(f"      TTFT p99: sidecar {rr['p99'] / side['p99']:.1f}x better")
    route = report["route"]
    lines.append(
        f"      routing decision (RouteReply.decision_ns, {route['calls']} calls): "
        f"p50 {route['decision_ns_p50'] / 1e3:.1f} us, p99 {route['decision_ns_p99'] / 1e3:.1f} "
        f"us; Route RPC round trip p50 {route['round_trip_us_p50']:.0f} us"
    )
    cost = report["cost_yuan_per_day"]
    raw = cost["raw"]
    lines.append("      daily cost, docs/mission.md's model (20M requests/day, 60k-token prefix):")
    lines.append(f"        no prefix cache          {raw:>12,.0f} yuan/day")
    for policy, label in labels.items():
        hit = results[policy]["hit_rate"]
        lines.append(
            f"        {label + f' (hit {100 * hit:.1f} %)':<25}{cost[policy]:>12,.0f} yuan/day "
            f"(-{100 * (raw - cost[policy]) / raw:.1f} %)"
        )
    lines.append(f"done in {report['wall_s']:.1f} s; the fleet and the sidecars are stopped.")
    return "\n".join(lines)


SUMMARY = "emulated fleet + sidecar: prewarm, mega-sale workload, sidecar vs round-robin"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "demo", SUMMARY, __doc__)
    parser.add_argument("--pods", type=int, default=4, help="emulated pods (4)")
    parser.add_argument("--prefixes", type=int, default=8, help="prefixes, Zipf popular (8)")
    parser.add_argument("--requests", type=int, default=360, help="merchant queries (360)")
    parser.add_argument("--rate", type=float, default=12.0, help="req/s, modelled (12)")
    parser.add_argument("--time-scale", type=float, default=5.0, help="emulator speed-up (5)")
    parser.add_argument(
        "--kv-tokens", type=int, default=120_000, help="KV capacity per pod, tokens (120000)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (16)")
    parser.add_argument(
        "--first-token-timeout",
        type=float,
        default=30.0,
        help="a caller gives up after this many modelled seconds without a token (30)",
    )
    parser.add_argument("--route-calls", type=int, default=500, help="Route RPCs timed (500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few seconds: 2 pods, 4 prefixes, 60 queries, time x20",
    )
    add_json_option(parser)
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    parser.set_defaults(func=run)


def _validate(args: argparse.Namespace) -> str | None:
    if args.quick:  # the test suite's run: seconds, same code path
        args.pods, args.prefixes, args.requests, args.route_calls = 2, 4, 60, 50
        args.time_scale = max(args.time_scale, 20.0)
    checks = [
        (args.pods >= 1, "--pods must be >= 1"),
        (args.prefixes >= 1, "--prefixes must be >= 1"),
        (args.requests >= 1, "--requests must be >= 1"),
        (args.rate > 0, "--rate must be > 0"),
        (args.time_scale > 0, "--time-scale must be > 0"),
        (args.kv_tokens >= 61_000, "--kv-tokens must hold the 60k-token rules (>= 61000)"),
        (args.max_tokens >= 1, "--max-tokens must be >= 1"),
        (args.first_token_timeout > 0, "--first-token-timeout must be > 0"),
        (args.route_calls >= 1, "--route-calls must be >= 1"),
    ]
    return next((message for ok, message in checks if not ok), None)


def run(args: argparse.Namespace) -> int:
    problem = _validate(args)
    if problem:
        print(f"prefix-sidecar demo: {problem}", file=sys.stderr)
        return 2
    random.seed(args.seed)
    out = Printer(args.quiet)
    report = run_and_report("prefix-sidecar demo", _demo(args, out), render, args.json)
    return 130 if report is None else 0
