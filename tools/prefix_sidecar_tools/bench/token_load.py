"""`prefix-sidecar bench tokens`: bounded load counted in tokens against counted in requests.

One emulated fleet, one trace, one run per load unit (config `load_unit`), each from the
same state (caches reset, every registered prefix prewarmed on its replica set), so only
what a pod's load counts differs. The workload is issue 30's mixed one: a tenth of the
requests carry a cold prompt of 8k-16k tokens nobody registered (each one new, so no pod
holds it), the rest are thin queries (200 tokens) of registered prefixes warm on their
homes. Counting requests, a pod computing a cold 16k-token prefill weighs one request, and
the thin queries of the prefixes homed there queue behind it; counting tokens it weighs
16k, and they go to their other home.

Reported per unit: TTFT p50/p99 of every request, of the thin and of the cold ones; the
thin queries' hit rate (their prefix's tokens the pods served from cache); requests per
pod. Times are modelled (the emulator's clock = real x --time-scale); the first --warmup
modelled seconds are replayed but not measured. Target: TTFT p99 at least 1.3x better with
tokens than with requests, at the same hit rate (within 0.01).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from typing import Any

from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.bench.argtypes import positive_float, positive_int
from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet
from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.report import add_command, add_json_option, run_and_report, target_lines
from prefix_sidecar_tools.workload.driver import TIMEOUT, Outcome, RequestFactory
from prefix_sidecar_tools.workload.scenario import run_policy
from prefix_sidecar_tools.workload.texts import merchant_query, rules_text, script_text
from prefix_sidecar_tools.workload.trace import Arrival, PrefixDef

UNITS = ("tokens", "requests")
COLD = -1  # an arrival's prefix index when it carries a cold prompt of its own
TARGET_P99_RATIO = 1.3
HIT_TOLERANCE = 0.01

Report = dict[str, Any]


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers, "tokens", "bounded load in tokens vs in requests, mixed load", __doc__
    )
    parser.add_argument("--pods", type=positive_int, default=4)
    parser.add_argument("--prefixes", type=positive_int, default=4, help="registered (4)")
    parser.add_argument("--prefix-tokens", type=positive_int, default=4000)
    parser.add_argument("--replicas", type=positive_int, default=2, help="per prefix (2)")
    parser.add_argument("--rate", type=positive_float, default=24.0, help="req/s, modelled")
    parser.add_argument("--duration", type=positive_float, default=60.0, help="modelled s")
    parser.add_argument("--warmup", type=float, default=10.0, help="modelled s not measured")
    parser.add_argument("--cold-share", type=float, default=0.1)
    parser.add_argument("--cold-tokens", default="8000,16000", metavar="LOW,HIGH")
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--time-scale", type=positive_float, default=2.0)
    parser.add_argument("--first-token-timeout", type=positive_float, default=30.0)
    parser.add_argument("--units", default=",".join(UNITS), help="tokens,requests")
    parser.add_argument("--seed", type=int, default=0)
    add_json_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    units = [unit for unit in args.units.split(",") if unit]
    if not units or any(unit not in UNITS for unit in units):
        raise SystemExit(f"--units: a comma-separated subset of {','.join(UNITS)}")
    report = run_and_report("bench tokens", measure(args, units), render, args.json)
    return 0 if report is not None else 130


def workload(args: argparse.Namespace) -> tuple[list[PrefixDef], list[Arrival]]:
    """The registered prefixes and the trace: Poisson arrivals, a `cold_share` of them
    a new prompt of LOW-HIGH tokens, the rest a prefix's thin query."""
    low, high = (int(part) for part in args.cold_tokens.split(","))
    weight = 1.0 / args.prefixes
    prefixes = [
        PrefixDef(f"rules-{n}", rules_text(args.prefix_tokens, seed=n), weight, args.replicas)
        for n in range(args.prefixes)
    ]
    rng = random.Random(f"tokens-{args.seed}")
    trace, at = [], 0.0
    for seq in range(int(args.rate * args.duration)):
        at += rng.expovariate(args.rate)
        if rng.random() < args.cold_share:
            text = script_text(rng.randint(low, high), seed=rng.randrange(1 << 30))
            trace.append(Arrival(seq, at, COLD, text))
        else:
            trace.append(Arrival(seq, at, rng.randrange(args.prefixes), merchant_query(rng)))
    return prefixes, trace


def mixed_requests(max_tokens: int) -> Any:
    """The request of each arrival: a cold prompt on its own, or a prefix's thin query."""

    def factory(ids: list[str]) -> RequestFactory:
        def make(arrival: Arrival) -> router_pb2.CompleteRequest:
            if arrival.prefix == COLD:
                return router_pb2.CompleteRequest(input=arrival.input, max_tokens=max_tokens)
            return router_pb2.CompleteRequest(
                prefix_id=ids[arrival.prefix], input=arrival.input, max_tokens=max_tokens
            )

        return make

    return factory


async def measure(args: argparse.Namespace, units: Sequence[str]) -> Report:
    prefixes, trace = workload(args)
    pod = EmulatorConfig(time_scale=args.time_scale, max_running=256, kv_tokens=400_000)
    measured = [a.seq for a in trace if a.at >= args.warmup]
    results: dict[str, Report] = {}
    async with EmulatorFleet(args.pods, pod) as fleet:
        for unit in units:
            run = await run_policy(
                fleet.urls,
                "prefix_affinity",
                prefixes,
                [p.replicas for p in prefixes],
                trace,
                time_scale=args.time_scale,
                max_tokens=args.max_tokens,
                first_token_timeout_s=args.first_token_timeout / args.time_scale,
                warmup_s=args.warmup,
                settings={"load_unit": unit},
                requests=mixed_requests(args.max_tokens),
            )
            outcomes = [run.outcomes[seq] for seq in measured]
            results[unit] = summary(outcomes, prefixes, args)
    return {
        "settings": {k: v for k, v in vars(args).items() if k not in ("func", "json")},
        "requests": len(measured),
        "cold": sum(1 for seq in measured if trace[seq].prefix == COLD),
        "results": results,
        "targets": targets(results),
    }


def summary(outcomes: Sequence[Outcome], prefixes: Sequence[PrefixDef], args: Any) -> Report:
    timeout_ms = args.first_token_timeout * 1e3

    def ttft(group: Sequence[Outcome]) -> dict[str, float]:
        times = [
            o.ttft_s * args.time_scale * 1e3 if o.ok else timeout_ms
            for o in group
            if o.ok or o.error == TIMEOUT
        ]
        return {"p50": percentile(times, 50), "p99": percentile(times, 99)}

    thin = [o for o in outcomes if o.prefix != COLD]
    cold = [o for o in outcomes if o.prefix == COLD]
    answered = [o for o in thin if o.ok]
    wanted = sum(prefixes[o.prefix].tokens for o in answered)
    cached = sum(min(o.cached_tokens, prefixes[o.prefix].tokens) for o in answered)
    pods: dict[str, int] = {}
    for o in outcomes:
        pods[o.backend or "-"] = pods.get(o.backend or "-", 0) + 1
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            errors[o.error.split(":", 1)[0]] = errors.get(o.error.split(":", 1)[0], 0) + 1
    return {
        "ttft_ms": ttft(outcomes),
        "thin_ttft_ms": ttft(thin),
        "cold_ttft_ms": ttft(cold),
        "thin_hit_rate": cached / wanted if wanted else 0.0,
        "per_pod": dict(sorted(pods.items())),
        "errors": errors,
    }


def targets(results: dict[str, Report]) -> list[Report]:
    tokens, requests = results.get("tokens"), results.get("requests")
    if tokens is None or requests is None:
        return []
    ratio = requests["ttft_ms"]["p99"] / tokens["ttft_ms"]["p99"]
    hit_gap = abs(tokens["thin_hit_rate"] - requests["thin_hit_rate"])
    return [
        {
            "name": f"TTFT p99 >= {TARGET_P99_RATIO}x better counting tokens, same hit rate",
            "measured": f"{ratio:.2f}x ({requests['ttft_ms']['p99']:,.0f} ms vs "
            f"{tokens['ttft_ms']['p99']:,.0f} ms), hit {tokens['thin_hit_rate']:.3f} vs "
            f"{requests['thin_hit_rate']:.3f}",
            "ratio": ratio,
            "met": ratio >= TARGET_P99_RATIO and hit_gap <= HIT_TOLERANCE,
        }
    ]


def render(report: Report) -> str:
    lines = [
        f"bench tokens: {report['requests']} measured requests, {report['cold']} cold "
        f"({report['settings']['cold_tokens']} tokens), the rest thin queries of "
        f"{report['settings']['prefixes']} registered prefixes",
        "",
        "| load unit | TTFT p50 | TTFT p99 | thin p50 | thin p99 | cold p50 | cold p99 "
        "| thin hit | per pod | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for unit, r in report["results"].items():
        t, thin, cold = r["ttft_ms"], r["thin_ttft_ms"], r["cold_ttft_ms"]
        lines.append(
            f"| {unit} | {t['p50']:,.0f} ms | {t['p99']:,.0f} ms | {thin['p50']:,.0f} ms "
            f"| {thin['p99']:,.0f} ms | {cold['p50']:,.0f} ms | {cold['p99']:,.0f} ms "
            f"| {r['thin_hit_rate']:.3f} | {'/'.join(map(str, r['per_pod'].values()))} "
            f"| {sum(r['errors'].values())} |"
        )
    lines += ["", *target_lines(report["targets"])]
    return "\n".join(lines)
