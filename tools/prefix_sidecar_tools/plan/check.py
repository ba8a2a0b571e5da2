"""`prefix-sidecar bench plan-check`: the planner's prediction against `bench fleet`, measured.

One small emulated fleet, one trace, two policies (round_robin and the sidecar,
prefix_affinity), two loads each: four `bench fleet` runs. For each run the planner's fleet
model (plan.fleet_sim: the real router and policy over the run's own pod URLs and prefix
texts, so the same ring and homes, feeding one M/G/c queue per pod) gets the same pod (built
from the emulator's config by plan.emulator_model, so they cannot drift), the same prefix
mix and the hit rate per prefix the run measured, and predicts:
- TTFT p99 at the run's load;
- QPS per pod at the SLO, with the SLO set to the p99 the run measured: the run shows that
  the fleet carries its load per pod at that p99, the planner says how much it could carry.
The TTFT the caller sees includes the hop outside the pods (client, sidecar, Python on a
shared box), which the pod model does not have: a fifth run, the sidecar at 10 % load where
almost nothing queues, measures its distribution (each TTFT minus an idle pod's prefill),
and every predicted TTFT gets one hop drawn from it (the hop and the pod's queue being
independent). Its p50 and p99 are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from statistics import median
from typing import Any

from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.plan import fleet_sim
from prefix_sidecar_tools.plan.capacity import SIDECAR, service_mix
from prefix_sidecar_tools.plan.emulator_model import pod_from_emulator
from prefix_sidecar_tools.plan.scenario import Prefix, Routing, Scenario, Traffic
from prefix_sidecar_tools.report import (
    add_command,
    add_json_option,
    progress_printer,
    run_and_report,
)

POLICIES = ("round_robin", "prefix_affinity")
TOLERANCE = 0.25


def fleet_args(args: argparse.Namespace, policy: str, rate: float) -> argparse.Namespace:
    from prefix_sidecar_tools.bench import fleet

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
        "max_tokens": args.max_tokens,
    }.items():
        setattr(parsed, key, value)
    return parsed


def scenario_of(report: dict[str, Any], policy: str, overhead_ms: float) -> Scenario:
    """The run as a planning scenario: its pod (the emulator's config, through
    pod_from_emulator), its prefix mix, and the hit rate per prefix it measured."""
    from prefix_sidecar_tools.emulator import EmulatorConfig

    emulator = report["emulator"]
    config = EmulatorConfig(
        kv_tokens=emulator["kv_tokens"],
        prefill_tps=emulator["prefill_tps"],
        prefill_overhead_s=emulator["prefill_overhead_s"],
        decode_tps=emulator["decode_tps"],
        max_running=emulator["max_running"],
    )
    by_prefix = report["results"][policy]["hit_rate_by_prefix"]
    total = sum(p["weight"] for p in report["prefixes"])
    prefixes = tuple(
        Prefix(p["name"], p["tokens"], p["weight"] / total, by_prefix.get(p["name"], 1.0))
        for p in report["prefixes"]
    )
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


def predict(
    scenario: Scenario,
    report: dict[str, Any],
    policy: str,
    rate: float,
    slo_s: float | None,
    args: argparse.Namespace,
    hop_s: list[float] | None = None,
) -> dict[str, float]:
    """What a bench fleet run of this length would measure, by the fleet model: TTFT p50
    and p99 as the median over `args.windows` simulated runs of the same length (same
    requests, same warm-up; a p99 over ~1,000 requests varies from run to run, and a long
    simulation's p99 is not what a short run sees), with the 5-95 % band of the p99; with
    `slo_s`, the QPS per pod at which that median p99 meets it."""
    from prefix_sidecar_tools.workload.trace import mega_sale_prefixes

    params = report["params"]
    texts = [
        p.text
        for p in mega_sale_prefixes(
            params["prefixes"],
            hot_tokens=params["hot_tokens"],
            tail_tokens=params["tail_tokens"],
            zipf=params["zipf"],
            seed=params["seed"],
        )
    ]
    urls = list(report["results"][policy]["load"]["per_pod"])
    replicas = {p["name"]: p["replicas"] for p in report["prefixes"]}
    budget = report["home_kv_budget_tokens"]
    pods = len(urls)

    def windows(at: float) -> tuple[list[float], list[float], list[float]]:
        p50s, p99s, loads = [], [], []
        for seed in range(args.windows):
            run = fleet_sim.simulate(
                scenario, pods, at, replicas, policy=policy, budget=budget, urls=urls,
                texts=texts, hop_s=hop_s or (), seed=seed,
                requests=max(2, round(at * params["duration"])),
                warm_up=round(at * params["warmup"]),
            )  # fmt: skip
            p50s.append(run.p(50))
            p99s.append(run.p(99))
            loads.append(run.max_over_mean)
        return sorted(p50s), sorted(p99s), loads

    p50s, p99s, loads = windows(rate)
    out = {
        "p50_ms": median(p50s) * 1e3,
        "p99_ms": median(p99s) * 1e3,
        "p99_low_ms": percentile(p99s, 5) * 1e3,
        "p99_high_ms": percentile(p99s, 95) * 1e3,
        "max_over_mean": median(loads),
    }
    if slo_s is not None:
        pod = scenario.pod
        mix = service_mix(scenario, SIDECAR)
        decode_s = max(0, scenario.traffic.output_tokens - 1) / pod.decode_tps
        low = 0.0
        high = pods * min(pod.prefill_slots / mix.mean, pod.max_running / (mix.mean + decode_s))
        while high - low > 0.01 * high:
            middle = (low + high) / 2
            if median(windows(middle)[1]) <= slo_s:
                low = middle
            else:
                high = middle
        out["qps_per_pod_at_slo"] = low / pods
    return out


async def run_check(args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    from prefix_sidecar_tools.bench.fleet import run_bench

    capacity = 1.0 / (0.012 + 200 / args.prefill_tps)
    # The hop outside the pods, once, at a load where nobody queues: p50 minus the model's.
    idle_rate = args.idle * capacity * args.pods
    progress(f"bench fleet: hop calibration, prefix_affinity at {idle_rate:.2f} req/s")
    idle = await run_bench(fleet_args(args, "prefix_affinity", idle_rate), progress)
    hop_ms, hops = hop_of(idle, args)
    loads = [args.low * capacity * args.pods, args.high * capacity * args.pods]
    rows = []
    for policy in POLICIES:
        for rate in loads:
            progress(f"bench fleet: {policy} at {rate:.2f} req/s on {args.pods} pods")
            report = await run_bench(fleet_args(args, policy, rate), progress)
            rows.append(compare(report, policy, rate, hops, args, capacity))
    return {
        "params": {k: v for k, v in vars(args).items() if k not in ("func", "command")},
        "warm_capacity_per_pod": capacity,
        "hop_ms": hop_ms,
        "hop_p99_ms": percentile(hops, 99) * 1e3,
        "calibration": idle,
        "rows": rows,
    }


def hop_of(idle: dict[str, Any], args: argparse.Namespace) -> tuple[float, list[float]]:
    """The hop outside the pods, from the calibration run at idle load: its median (ms) and
    its distribution (s), each measured TTFT minus an idle pod's prefill (what a request
    that did not queue would take), never below 0."""
    policy = "prefix_affinity"
    rate = idle["params"]["rate"]
    scenario = scenario_of(idle, policy, 0.0)
    bare = predict(scenario, idle, policy, rate, None, args)
    service_ms = idle_service_ms(scenario)
    samples = idle["ttft_samples_ms"][policy]
    hops = [max(0.0, ms - service_ms) / 1e3 for ms in samples]
    return max(0.0, idle["results"][policy]["ttft_ms"]["p50"] - bare["p50_ms"]), hops


def idle_service_ms(scenario: Scenario) -> float:
    mix = service_mix(scenario, SIDECAR)
    return mix.quantile(0.5) * 1e3


def compare(
    report: dict[str, Any],
    policy: str,
    rate: float,
    hops: list[float],
    args: argparse.Namespace,
    capacity: float,
) -> dict[str, Any]:
    """One run, measured and predicted side by side."""
    report.pop("ttft_samples_ms", None)
    result = report["results"][policy]
    slo_ms = result["ttft_ms"]["p99"]
    guess = predict(
        scenario_of(report, policy, 0.0), report, policy, rate, slo_ms / 1e3, args, hops
    )
    measured_qps = rate / args.pods
    row: dict[str, Any] = {
        "policy": policy,
        "rate": rate,
        "utilisation": rate / args.pods / capacity,
        "hit_rate": result["hit_rate"],
        "max_over_mean": result["load"]["max_over_mean"],
        "predicted_max_over_mean": guess["max_over_mean"],
        "measured_p50_ms": result["ttft_ms"]["p50"],
        "measured_p99_ms": slo_ms,
        "timeouts": result["errors"].get("TTFT_TIMEOUT", 0),
        "predicted_p50_ms": guess["p50_ms"],
        "predicted_p99_ms": guess["p99_ms"],
        "predicted_p99_band_ms": [guess["p99_low_ms"], guess["p99_high_ms"]],
        "p99_ratio": guess["p99_ms"] / slo_ms,
        "measured_qps_per_pod_at_slo": measured_qps,
        "predicted_qps_per_pod_at_slo": guess["qps_per_pod_at_slo"],
        "qps_ratio": guess["qps_per_pod_at_slo"] / measured_qps,
    }
    row["met"] = (
        all(abs(row[k] - 1.0) <= TOLERANCE for k in ("p99_ratio", "qps_ratio"))
        and not result["ttft_ms"]["lower_bound"]
    )
    row["bench"] = report
    return row


def replay(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """The predictions again, for the bench runs a saved plan-check JSON holds (no fleet)."""
    with open(path, encoding="utf-8") as handle:
        saved = json.load(handle)
    capacity = saved["warm_capacity_per_pod"]
    args.pods, args.windows = saved["params"]["pods"], saved["params"].get("windows", 15)
    hop_ms, hops = hop_of(saved["calibration"], args)
    rows = [
        compare(row["bench"], row["policy"], row["rate"], hops, args, capacity)
        for row in saved["rows"]
    ]
    return {
        **saved,
        "hop_ms": hop_ms,
        "hop_p99_ms": percentile(hops, 99) * 1e3,
        "rows": rows,
        "replayed_from": path,
    }


def render(report: dict[str, Any]) -> str:
    p = report["params"]
    lines = [
        f"prefix-sidecar bench plan-check: {p['pods']} pods, {p['prefixes']} prefixes "
        f"({p['hot_tokens']:,} + {p['tail_tokens']:,}-token tail), prefill {p['prefill_tps']:,.0f} "
        f"tok/s, KV {p['kv_tokens']:,}, time x{p['time_scale']:g}; warm capacity "
        f"{report['warm_capacity_per_pod']:.2f} req/s per pod",
        f"hop outside the pods (client, sidecar, a shared box), from the run at "
        f"{100 * report['params']['idle']:g} % load: p50 {report['hop_ms']:.0f} ms, p99 "
        f"{report['hop_p99_ms']:.0f} ms; each predicted TTFT gets one hop drawn from it",
        "",
        f"{'policy':<16}{'req/s':>7}{'util':>6}{'hit':>8}{'max/mean':>9}{'p50 meas':>9}"
        f"{'pred':>6}"
        f"{'p99 meas':>10}{'p99 pred':>10}{'ratio':>7}"
        f"{'QPS/pod@SLO meas':>18}{'pred':>7}{'ratio':>7}  within 25 %",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['policy']:<16}{r['rate']:>7.2f}{100 * r['utilisation']:>5.0f}%"
            f"{r['hit_rate']:>8.4f}{r['max_over_mean']:>9.2f}{r['measured_p50_ms']:>9,.0f}"
            f"{r['predicted_p50_ms']:>6,.0f}{r['measured_p99_ms']:>10,.0f}{r['predicted_p99_ms']:>10,.0f}"
            f"{r['p99_ratio']:>7.2f}{r['measured_qps_per_pod_at_slo']:>18.2f}"
            f"{r['predicted_qps_per_pod_at_slo']:>7.2f}{r['qps_ratio']:>7.2f}  "
            + ("MET" if r["met"] else "NOT MET")
        )
    met = sum(r["met"] for r in report["rows"])
    lines += ["", f"{met} of {len(report['rows'])} runs within ±25 % on both (TTFT in modelled ms)"]
    return "\n".join(lines)


SUMMARY = "the planner's prediction against bench fleet: round-robin and sidecar, two loads"


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(bench_subparsers, "plan-check", SUMMARY, __doc__)
    add = parser.add_argument
    add("--pods", type=int, default=3)
    add("--prefixes", type=int, default=3)
    add("--hot-tokens", type=int, default=4_000)
    add("--tail-tokens", type=int, default=1_000)
    add("--kv-tokens", type=int, default=150_000)
    add("--prefill-tps", type=float, default=500.0, help="slow pods: the hop is small beside")
    add("--max-tokens", type=int, default=4, help="chunks per stream (4: less relaying CPU)")
    add("--idle", type=float, default=0.1, help="the hop calibration's load (0.1)")
    add("--low", type=float, default=0.65, help="low load, fraction of warm capacity (0.65)")
    add("--high", type=float, default=0.85, help="high load, fraction of warm capacity (0.85)")
    add("--duration", type=float, default=150.0, help="modelled s per run (150)")
    add("--warmup", type=float, default=20.0)
    add("--time-scale", type=float, default=2.0)
    add("--windows", type=int, default=15, help="simulated runs per prediction (15)")
    add("--seed", type=int, default=0)
    add("--replay", metavar="JSON", help="recompute the predictions of a saved run, no fleet")
    add("--quick", action="store_true", help="seconds, for tests (numbers not meaningful)")
    add_json_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.pods, args.duration, args.warmup, args.time_scale = 2, 20.0, 4.0, 10.0
        args.windows = 5
    if not (0 < args.low < args.high < 1):
        print("prefix-sidecar bench plan-check: need 0 < --low < --high < 1", file=sys.stderr)
        return 2
    measure: Any = (
        (lambda: replay(args.replay, args))
        if args.replay
        else run_check(args, progress_printer("plan-check"))
    )
    report = run_and_report("bench plan-check", measure, render, args.json)
    return 130 if report is None else 0
