"""`prefix-sidecar bench plan-check`: the planner's prediction against `bench fleet`, measured.

One small emulated fleet, one trace, two policies (round_robin and the sidecar,
prefix_affinity), two loads each: four `bench fleet` runs. For each run the planner gets the
same pod (built from the emulator's config by plan.emulator_model, so they cannot drift),
the same prefix mix, the hit rate per prefix and the per-pod load split that run measured,
and predicts:
- TTFT p99 at the run's load (pooled over the pods, each an M/G/c queue at its own rate);
- QPS per pod at the SLO, with the SLO set to the p99 the run measured: the run shows that
  the fleet carries its load per pod at that p99, the planner says how much it could carry.
The TTFT the caller sees includes the hop outside the pods (client, sidecar, Python on a
shared box), which the pod model does not have: it is measured once, as the sidecar's p50
at the low load minus the model's p50 there, and added to every prediction (reported).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import Any

from sidecar.tools.plan import queueing
from sidecar.tools.plan.capacity import SIDECAR, service_mix
from sidecar.tools.plan.emulator_model import pod_from_emulator
from sidecar.tools.plan.scenario import Prefix, Routing, Scenario, Traffic
from sidecar.tools.report import add_json_option, progress_printer, run_and_report

POLICIES = ("round_robin", "prefix_affinity")
TOLERANCE = 0.25


def fleet_args(args: argparse.Namespace, policy: str, rate: float) -> argparse.Namespace:
    from sidecar.tools.bench import fleet

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    fleet.register(sub)
    parsed = parser.parse_args(["fleet"])
    for key, value in {
        "pods": args.pods,
        "prefixes": args.prefixes,
        "hot_tokens": args.hot_tokens,
        "tail_tokens": args.tail_tokens,
        "kv_tokens": args.kv_tokens,
        "prefill_tps": args.prefill_tps,
        "rate": rate,
        "duration": args.duration,
        "warmup": args.warmup,
        "time_scale": args.time_scale,
        "policies": policy,
        "seed": args.seed,
    }.items():
        setattr(parsed, key, value)
    return parsed


def predict(
    scenario: Scenario, shares: list[float], rate: float, slo_s: float, samples: int
) -> dict[str, float]:
    """Pooled TTFT p50/p99 at `rate` split by `shares`, and the QPS per pod at `slo_s`."""
    from sidecar.tools.plan.capacity import own_tokens

    pod, t = scenario.pod, scenario.traffic
    mix = service_mix(scenario, SIDECAR)
    decode_s = max(0, t.output_tokens - 1) / pod.decode_tps
    resident = sum(p.tokens for p in t.prefixes)
    kv_slots = math.floor((pod.kv_tokens - resident) / own_tokens(scenario, SIDECAR))
    queue = queueing.PodQueue(
        pod.prefill_slots, min(pod.max_running, kv_slots), decode_s, pod.overhead_ms / 1e3
    )
    p50, p99 = queueing.evaluate_fleet(queue, mix, [rate * s for s in shares], samples=samples)
    at_slo = queueing.max_fleet_rate_at_slo(queue, mix, shares, slo_s, samples=samples)
    return {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "qps_per_pod_at_slo": at_slo / len(shares)}


def scenario_of(
    report: dict[str, Any], policy: str, args: argparse.Namespace, overhead_ms: float
) -> Scenario:
    from sidecar.tools.bench.fleet import run_bench  # noqa: F401 (the same module's pod)
    from sidecar.tools.emulator import EmulatorConfig

    emulator = report["emulator"]
    config = EmulatorConfig(
        kv_tokens=emulator["kv_tokens"],
        prefill_tps=emulator["prefill_tps"],
        prefill_overhead_s=emulator["prefill_overhead_s"],
        decode_tps=emulator["decode_tps"],
        max_running=emulator["max_running"],
    )
    result = report["results"][policy]
    by_prefix = result["hit_rate_by_prefix"]
    prefixes = tuple(
        Prefix(p["name"], p["tokens"], p["weight"], by_prefix.get(p["name"], 1.0))
        for p in report["prefixes"]
    )
    total = sum(p.share for p in prefixes)
    prefixes = tuple(Prefix(p.name, p.tokens, p.share / total, p.hit_rate) for p in prefixes)
    return Scenario(
        name=f"plan-check {policy}",
        traffic=Traffic(
            peak_rps=report["params"]["rate"],
            prefixes=prefixes,
            query_tokens=200,
            output_tokens=report["params"]["max_tokens"],
            slo_ms=1.0,
        ),
        pod=pod_from_emulator(config, overhead_ms=overhead_ms),
        routing=Routing(miss="whole", source=f"bench fleet ({policy})"),
    )


async def run_check(args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    from sidecar.tools.bench.fleet import run_bench

    capacity = 1.0 / (0.012 + 200 / args.prefill_tps)
    loads = [args.low * capacity * args.pods, args.high * capacity * args.pods]
    runs: list[dict[str, Any]] = []
    for policy in POLICIES:
        for rate in loads:
            progress(f"bench fleet: {policy} at {rate:.2f} req/s on {args.pods} pods")
            report = await run_bench(fleet_args(args, policy, rate), progress)
            runs.append({"policy": policy, "rate": rate, "report": report})
    # The hop outside the pods: the sidecar's low-load p50 over the model's p50 there.
    calibration = runs[2]
    scenario = scenario_of(calibration["report"], "prefix_affinity", args, 0.0)
    shares = _shares(calibration["report"], "prefix_affinity")
    bare = predict(scenario, shares, calibration["rate"], 10.0, args.samples)
    measured_p50 = calibration["report"]["results"]["prefix_affinity"]["ttft_ms"]["p50"]
    overhead_ms = max(0.0, measured_p50 - bare["p50_ms"])
    rows = []
    for run in runs:
        result = run["report"]["results"][run["policy"]]
        scenario = scenario_of(run["report"], run["policy"], args, overhead_ms)
        shares = _shares(run["report"], run["policy"])
        slo_ms = result["ttft_ms"]["p99"]
        guess = predict(scenario, shares, run["rate"], slo_ms / 1e3, args.samples)
        measured_qps = run["rate"] / args.pods
        row = {
            "policy": run["policy"],
            "rate": run["rate"],
            "utilisation": run["rate"] / args.pods / capacity,
            "hit_rate": result["hit_rate"],
            "max_over_mean": result["load"]["max_over_mean"],
            "measured_p50_ms": result["ttft_ms"]["p50"],
            "measured_p99_ms": slo_ms,
            "timeouts": result["errors"].get("TTFT_TIMEOUT", 0),
            "predicted_p50_ms": guess["p50_ms"],
            "predicted_p99_ms": guess["p99_ms"],
            "p99_ratio": guess["p99_ms"] / slo_ms,
            "measured_qps_per_pod_at_slo": measured_qps,
            "predicted_qps_per_pod_at_slo": guess["qps_per_pod_at_slo"],
            "qps_ratio": guess["qps_per_pod_at_slo"] / measured_qps,
        }
        row["met"] = (
            all(abs(row[k] - 1.0) <= TOLERANCE for k in ("p99_ratio", "qps_ratio"))
            and not result["ttft_ms"]["lower_bound"]
        )
        rows.append(row)
    return {
        "params": {k: v for k, v in vars(args).items() if k not in ("func", "command")},
        "warm_capacity_per_pod": capacity,
        "overhead_ms": overhead_ms,
        "rows": rows,
    }


def _shares(report: dict[str, Any], policy: str) -> list[float]:
    loads = list(report["results"][policy]["load"]["per_pod"].values())
    total = sum(loads)
    return [load / total for load in loads] if total else [1 / len(loads)] * len(loads)


def render(report: dict[str, Any]) -> str:
    p = report["params"]
    lines = [
        f"prefix-sidecar bench plan-check: {p['pods']} pods, {p['prefixes']} prefixes "
        f"({p['hot_tokens']:,} + {p['tail_tokens']:,}-token tail), prefill {p['prefill_tps']:,.0f} "
        f"tok/s, KV {p['kv_tokens']:,}, time x{p['time_scale']:g}; warm capacity "
        f"{report['warm_capacity_per_pod']:.2f} req/s per pod",
        f"hop outside the pods (sidecar low-load p50 - model p50): {report['overhead_ms']:.1f} ms, "
        "added to every prediction",
        "",
        f"{'policy':<16}{'req/s':>7}{'util':>6}{'hit':>8}{'max/mean':>9}"
        f"{'p99 meas':>10}{'p99 pred':>10}{'ratio':>7}"
        f"{'QPS/pod@SLO meas':>18}{'pred':>7}{'ratio':>7}  within 25 %",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['policy']:<16}{r['rate']:>7.2f}{100 * r['utilisation']:>5.0f}%"
            f"{r['hit_rate']:>8.4f}{r['max_over_mean']:>9.2f}{r['measured_p99_ms']:>10,.0f}{r['predicted_p99_ms']:>10,.0f}"
            f"{r['p99_ratio']:>7.2f}{r['measured_qps_per_pod_at_slo']:>18.2f}"
            f"{r['predicted_qps_per_pod_at_slo']:>7.2f}{r['qps_ratio']:>7.2f}  "
            + ("MET" if r["met"] else "NOT MET")
        )
    met = sum(r["met"] for r in report["rows"])
    lines += ["", f"{met} of {len(report['rows'])} runs within ±25 % on both (TTFT in modelled ms)"]
    return "\n".join(lines)


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "plan-check",
        help="the planner's prediction against bench fleet: round-robin and sidecar, two loads",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--pods", type=int, default=2)
    add("--prefixes", type=int, default=3)
    add("--hot-tokens", type=int, default=4_000)
    add("--tail-tokens", type=int, default=1_000)
    add("--kv-tokens", type=int, default=150_000)
    add("--prefill-tps", type=float, default=1_000.0, help="slow pods: the hop is small beside")
    add("--low", type=float, default=0.5, help="low load, fraction of warm capacity (0.5)")
    add("--high", type=float, default=0.8, help="high load, fraction of warm capacity (0.8)")
    add("--duration", type=float, default=150.0, help="modelled s per run (150)")
    add("--warmup", type=float, default=20.0)
    add("--time-scale", type=float, default=3.0)
    add("--samples", type=int, default=40_000)
    add("--seed", type=int, default=0)
    add("--quick", action="store_true", help="seconds, for tests (numbers not meaningful)")
    add_json_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.duration, args.warmup, args.time_scale, args.samples = 20.0, 4.0, 10.0, 5_000
    if not (0 < args.low < args.high < 1):
        print("prefix-sidecar bench plan-check: need 0 < --low < --high < 1", flush=True)
        return 2
    report = run_and_report(
        "bench plan-check", run_check(args, progress_printer("plan-check")), render, args.json
    )
    return 130 if report is None else 0


__all__ = ["asyncio", "register", "run"]
