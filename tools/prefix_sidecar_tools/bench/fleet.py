"""`prefix-sidecar bench fleet`: routing policies side by side on one emulated fleet.

One fleet, one trace, six runs: round-robin, random, least-loaded, plain consistent hash,
the sidecar's bounded-load replica routing (prefix_affinity), and the same with K sidecar
processes sharing the traffic. Every run is the same sidecar binary with another policy,
starting from the same state (caches reset, every prefix prewarmed on its replica set), so
only the pick differs. Workload: one dominant 60k-token rules prefix plus a Zipf tail,
200-token merchant inputs, Poisson arrivals; each pod's KV holds only a few prefixes.

Times are modelled (the emulator's clock = real x --time-scale). The first --warmup
seconds of the trace are replayed but not measured. Definitions: docs/benchmarks.md.

The pods' own load is recorded through every run (their /metrics, sampled ~10 times a real
second): the peak and mean in flight per pod (running + waiting) and vllm:num_requests_waiting.
`--also-sidecars 8` adds runs with more sidecar processes; `--compare-signals` runs every
sidecar policy again with the pod load signals off (`load_signals: false`, `_nosig`);
`--compare-rules` with the pods' readings used otherwise than by the default fleet view:
not for picks (`_own`, v1's own in-flight loads) or as the saturation report (`_sat`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from prefix_sidecar.membership.load_signals import MetricsError, fetch_metrics
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar_tools.bench.argtypes import positive_float, positive_int
from prefix_sidecar_tools.emulator import EmulatorFleet
from prefix_sidecar_tools.report import (
    add_command,
    add_json_option,
    progress_printer,
    run_and_report,
    target_lines,
)
from prefix_sidecar_tools.workload.driver import TIMEOUT
from prefix_sidecar_tools.workload.scenario import run_policy
from prefix_sidecar_tools.workload.stats import hit_rate, summarize, ttft_samples_ms
from prefix_sidecar_tools.workload.trace import (
    INPUT_TOKENS,
    mega_sale_pod,
    mega_sale_prefixes,
    poisson_trace,
    size_fleet,
)

BASELINES = ("round_robin", "random", "least_loaded", "consistent_hash")
SIDECAR = "prefix_affinity"
TARGET_HIT_RATE = 0.964
TARGET_MAX_OVER_MEAN = 1.25
TARGET_P99_RATIO = 20.0
HIT_RATE_TOLERANCE = 0.001  # "K sidecars lose no hit rate": within 0.1 percentage point
TARGET_MANY_P99_RATIO = 1.5  # K sidecars' TTFT p99 within 1.5x of one sidecar's
# How a sidecar run reads the pods (docs/load-signals.md), by the suffix of its name: the
# sidecar's defaults (the fleet view, rule 3), not at all, the saturation report (rule 2),
# or readings kept but picks on own in-flight counts only (v1's loads).
FLEET, SIGNALS_OFF, SATURATION, OWN = "fleet", "off", "saturation", "own"
NO_SIGNALS, WITH_SATURATION, OWN_COUNTS = "_nosig", "_sat", "_own"
SUFFIXES = {NO_SIGNALS: SIGNALS_OFF, WITH_SATURATION: SATURATION, OWN_COUNTS: OWN}
SAMPLE_INTERVAL_S = 0.1  # real seconds between two reads of every pod's /metrics


def multi_name(sidecars: int) -> str:
    return f"{SIDECAR}_x{sidecars}"


def evaluate_targets(
    results: dict[str, Any], sidecars: int, also: Sequence[int] = ()
) -> list[dict[str, Any]]:
    """The targets, as measured in this run: the three of the fleet bench, and for every K
    sidecar processes that ran, TTFT p99 within 1.5x of one sidecar's."""
    one = results.get(SIDECAR)
    many = results.get(multi_name(sidecars))
    rr = results.get("round_robin")
    targets: list[dict[str, Any]] = []
    if one is not None:
        hit, balance = one["hit_rate"], one["load"]["max_over_mean"]
        targets.append(
            {
                "name": f"sidecar hit rate >= {TARGET_HIT_RATE} with max/mean load <= "
                f"{TARGET_MAX_OVER_MEAN}",
                "measured": f"hit rate {hit:.4f}, max/mean {balance:.3f}",
                "met": hit >= TARGET_HIT_RATE and balance <= TARGET_MAX_OVER_MEAN,
            }
        )
    if one is not None and many is not None:
        targets.append(
            {
                "name": f"{sidecars} sidecar processes lose no hit rate vs one "
                f"(within {100 * HIT_RATE_TOLERANCE:g} pp)",
                "measured": f"{many['hit_rate']:.4f} vs {one['hit_rate']:.4f}",
                "met": many["hit_rate"] >= one["hit_rate"] - HIT_RATE_TOLERANCE,
            }
        )
    for count in (sidecars, *also):
        many = results.get(multi_name(count))
        if one is None or many is None:
            continue
        ratio = many["ttft_ms"]["p99"] / one["ttft_ms"]["p99"]
        targets.append(
            {
                "name": f"{count} sidecar processes: TTFT p99 within "
                f"{TARGET_MANY_P99_RATIO:g}x of one sidecar's, hit rate unchanged",
                "measured": f"{ratio:.2f}x ({many['ttft_ms']['p99']:,.0f} ms vs "
                f"{one['ttft_ms']['p99']:,.0f} ms), hit rate {many['hit_rate']:.4f} vs "
                f"{one['hit_rate']:.4f}",
                "ratio": ratio,
                "met": ratio <= TARGET_MANY_P99_RATIO
                and many["hit_rate"] >= one["hit_rate"] - HIT_RATE_TOLERANCE,
            }
        )
    if one is not None and rr is not None:
        ratio = rr["ttft_ms"]["p99"] / one["ttft_ms"]["p99"]
        bound = ">=" if rr["ttft_ms"]["lower_bound"] else ""
        targets.append(
            {
                "name": f"sidecar TTFT p99 >= {TARGET_P99_RATIO:g}x better than round-robin",
                "measured": f"{bound}{ratio:.1f}x ({rr['ttft_ms']['p99']:,.0f} ms vs "
                f"{one['ttft_ms']['p99']:,.0f} ms)",
                "ratio": ratio,
                "ratio_is_lower_bound": bool(bound),
                "met": ratio >= TARGET_P99_RATIO,
            }
        )
    return targets


def policy_names(args: argparse.Namespace) -> list[str]:
    """Every run of this bench, in order: the baselines, one sidecar, K sidecars (and each
    sidecar run again without the pod signals with --compare-signals)."""
    counts = [args.sidecars, *(k for k in args.also_sidecars if k != args.sidecars)]
    sidecar = [SIDECAR, *(multi_name(k) for k in counts)]
    suffixes = [""]
    if args.compare_signals:
        suffixes.append(NO_SIGNALS)
    if args.compare_rules:
        suffixes += [OWN_COUNTS, WITH_SATURATION]
    sidecar = [name + suffix for name in sidecar for suffix in suffixes]
    names = [*BASELINES, *sidecar]
    if args.policies:  # a subset, in the default order (validated in run())
        names = [name for name in names if name in args.policies.split(",")]
    return names


def split_name(name: str) -> tuple[str, int, str]:
    """A run's name -> (policy, sidecar processes, how it reads the pods)."""
    signals = FLEET
    base = name
    for suffix, mode in SUFFIXES.items():
        if name.endswith(suffix):
            signals, base = mode, name.removesuffix(suffix)
    if base.startswith(SIDECAR + "_x"):
        return SIDECAR, int(base[len(SIDECAR) + 2 :]), signals
    return base, 1, signals


class PodSampler:
    """Reads every pod's own gauges every `interval_s` while a run goes: in flight per pod
    (running + waiting) and vllm:num_requests_waiting, as the pods count them."""

    def __init__(self, urls: Sequence[str], interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.urls = list(urls)
        self.interval_s = interval_s
        self.peak_in_flight = 0.0
        self.in_flight_sum = 0.0  # sum over samples of the mean in flight per pod
        self.peak_waiting = 0.0
        self.waiting_sum = 0.0
        self.samples = 0

    async def run(self) -> None:
        if self.interval_s <= 0:
            return
        async with UpstreamClient() as client:
            while True:
                reads = await asyncio.gather(
                    *(fetch_metrics(client, url, timeout_s=2.0) for url in self.urls),
                    return_exceptions=True,
                )
                reports = [r for r in reads if not isinstance(r, (MetricsError, BaseException))]
                if len(reports) == len(self.urls):
                    in_flight = [(r.running or 0.0) + (r.waiting or 0.0) for r in reports]
                    waiting = [r.waiting or 0.0 for r in reports]
                    self.peak_in_flight = max(self.peak_in_flight, *in_flight)
                    self.in_flight_sum += sum(in_flight) / len(in_flight)
                    self.peak_waiting = max(self.peak_waiting, *waiting)
                    self.waiting_sum += sum(waiting) / len(waiting)
                    self.samples += 1
                await asyncio.sleep(self.interval_s)

    def summary(self) -> dict[str, float]:
        samples = max(1, self.samples)
        mean = self.in_flight_sum / samples
        return {
            "samples": self.samples,
            "peak_in_flight": self.peak_in_flight,
            "mean_in_flight": mean,
            "max_over_mean": self.peak_in_flight / mean if mean else 0.0,
            "peak_waiting": self.peak_waiting,
            "mean_waiting": self.waiting_sum / samples,
        }


async def run_bench(args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    scale = args.time_scale
    config = mega_sale_pod(scale, args.kv_tokens, args.max_tokens)
    if args.pod_load_header:  # pods that also report their load on streams
        config = dataclasses.replace(config, load_header_on_streams=True)
    if getattr(args, "prefill_tps", None):  # bench plan-check: a slower pod (docs/plan.md)
        config = dataclasses.replace(config, prefill_tps=args.prefill_tps)
    prefixes = mega_sale_prefixes(
        args.prefixes,
        hot_tokens=args.hot_tokens,
        tail_tokens=args.tail_tokens,
        zipf=args.zipf,
        seed=args.seed,
    )
    sizing = size_fleet(config, prefixes, args.rate, args.pods, args.max_tokens)
    capacity, replicas = sizing.capacity, sizing.replicas
    budget = sizing.budget if args.home_budget is None else args.home_budget
    requests = max(1, round(args.rate * args.duration))
    trace = poisson_trace(prefixes, requests, args.rate, input_tokens=INPUT_TOKENS, seed=args.seed)
    tokens = [p.tokens for p in prefixes]
    timeout_s = args.first_token_timeout / scale
    policies = policy_names(args)
    results: dict[str, Any] = {}
    samples: dict[str, list[float]] = {}
    homes: dict[str, dict[str, list[str]]] = {}  # "ring" / "sidecar" -> prefix -> pods
    started = time.perf_counter()
    async with EmulatorFleet(args.pods, config, base_port=args.base_port) as fleet:
        progress(
            f"fleet of {args.pods} pods up; {requests} requests at {args.rate:g} req/s "
            f"(modelled), warm-up {args.warmup:g} s, time x{scale:g}"
        )
        for name in policies:
            policy, sidecars, signals = split_name(name)
            settings: dict[str, object] = {
                "grace_s": 1,
                "load_signals": signals != SIGNALS_OFF,
                "load_report_saturation": signals == SATURATION,
                "load_fleet_view": signals == FLEET,  # the sidecar's default
            }
            if policy == SIDECAR:  # the baselines keep the plain ring's homes for prewarm
                settings["home_kv_budget_tokens"] = budget
                settings["home_balance_factor"] = args.home_balance
                settings.update(args.sidecar_set)
            sampler = PodSampler(fleet.urls, args.pod_sample_s)
            sampling = asyncio.create_task(sampler.run())
            run = await run_policy(
                fleet.urls,
                policy,
                prefixes,
                replicas,
                trace,
                time_scale=scale,
                max_tokens=args.max_tokens,
                first_token_timeout_s=timeout_s,
                warmup_s=args.warmup,
                sidecars=sidecars,
                settings=settings,
            )
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
            if args.outcomes:
                write_outcomes(args.outcomes, name, run.outcomes, trace)
            measured = [o for o, a in zip(run.outcomes, trace, strict=True) if a.at >= args.warmup]
            results[name] = summarize(
                measured,
                tokens,
                fleet.urls,
                scale,
                first_token_timeout_s=timeout_s,
                loads=run.pod_requests,
            )
            results[name]["sidecars"] = sidecars
            results[name]["load_signals"] = signals != SIGNALS_OFF
            results[name]["load_rule"] = signals
            results[name]["pods_own"] = sampler.summary()
            results[name]["wall_s"] = run.wall_s
            results[name]["hit_rate_by_prefix"] = {
                p.name: hit_rate([o for o in measured if o.prefix == i], tokens)
                for i, p in enumerate(prefixes)
            }
            timed_out = sum(1 for o in measured if o.error == TIMEOUT)
            samples[name] = ttft_samples_ms(measured, scale) + [args.first_token_timeout * 1e3] * (
                timed_out
            )
            homes["sidecar" if policy == SIDECAR else "ring"] = run.home_sets
            r = results[name]
            own = r["pods_own"]
            progress(
                f"{name:<22} hit {r['hit_rate']:.4f}  p50 {r['ttft_ms']['p50']:>9,.0f} ms  "
                f"p99 {r['ttft_ms']['p99']:>9,.0f} ms  max/mean "
                f"{r['load']['max_over_mean']:.2f}  in flight peak/mean "
                f"{own['peak_in_flight']:.0f}/{own['mean_in_flight']:.1f}  waiting peak "
                f"{own['peak_waiting']:.0f}  ({run.wall_s:.0f} s)"
            )
    homed: dict[str, dict[str, int]] = {}
    for placement, sets in homes.items():
        homed[placement] = dict.fromkeys(fleet.urls, 0)
        for prefix in prefixes:
            for url in sets.get(prefix.name, []):
                homed[placement][url] += prefix.tokens
    sidecar_homes = homes.get("sidecar", homes.get("ring", {}))
    return {
        "params": {k: v for k, v in vars(args).items() if k not in ("func", "command")},
        "home_kv_budget_tokens": budget,
        "home_balance_factor": args.home_balance,
        "homed_prefix_tokens": homed,
        "emulator": {
            "kv_tokens": config.kv_tokens,
            "prefill_tps": config.prefill_tps,
            "prefill_overhead_s": config.prefill_overhead_s,
            "decode_tps": config.decode_tps,
            "max_running": config.max_running,
            "warm_capacity_req_s": capacity,
            "utilisation": args.rate / args.pods / capacity,
        },
        "prefixes": [
            {
                "name": p.name,
                "tokens": p.tokens,
                "weight": p.weight,
                "replicas": r,
                "home_set": sidecar_homes.get(p.name, []),
            }
            for p, r in zip(prefixes, replicas, strict=True)
        ],
        "measured_requests": sum(1 for a in trace if a.at >= args.warmup),
        "results": results,
        "targets": evaluate_targets(results, args.sidecars, args.also_sidecars),
        "ttft_samples_ms": samples,
        "wall_s": time.perf_counter() - started,
    }


def render(report: dict[str, Any]) -> str:
    params = report["params"]
    lines = [
        f"prefix-sidecar bench fleet: {params['pods']} pods, {len(report['prefixes'])} "
        f"prefixes (Zipf {params['zipf']:g}), {params['rate']:g} req/s, "
        f"{report['measured_requests']} measured requests, time x{params['time_scale']:g}"
        + ("  [--quick]" if params["quick"] else ""),
        f"pod: KV {report['emulator']['kv_tokens']:,} tokens, warm capacity "
        f"{report['emulator']['warm_capacity_req_s']:.1f} req/s, mean utilisation "
        f"{100 * report['emulator']['utilisation']:.0f} %",
        "replicas: "
        + ", ".join(
            f"{p['name']} ({p['tokens']:,} tok, {100 * p['weight']:.1f} %) x{p['replicas']}"
            for p in report["prefixes"][:4]
        )
        + (" ..." if len(report["prefixes"]) > 4 else ""),
        f"prefix tokens homed per pod, vs KV {report['emulator']['kv_tokens']:,} "
        f"(sidecar budget {report['home_kv_budget_tokens']:,}, balance "
        f"{report['home_balance_factor']:g}; 0 = off):",
        *(
            f"  {placement:<8}"
            + ", ".join(f"{url.rsplit(':', 1)[1]} {tokens:,}" for url, tokens in homed.items())
            for placement, homed in report["homed_prefix_tokens"].items()
        ),
        "",
        f"{'policy':<30}{'hit rate':>9}{'TTFT p50':>11}{'TTFT p99':>12}{'max/mean':>10}"
        f"{'req/s':>8}{'timeouts':>10}{'yuan/day':>12}{'in flight pk/mean':>19}"
        f"{'waiting pk':>11}",
    ]
    for name, r in report["results"].items():
        ttft = r["ttft_ms"]
        p99 = (">" if ttft["lower_bound"] else "") + f"{ttft['p99']:,.0f}"
        own = r.get("pods_own", {})
        lines.append(
            f"{name:<30}{r['hit_rate']:>9.4f}{ttft['p50']:>11,.0f}{p99:>12}"
            f"{r['load']['max_over_mean']:>10.2f}{r['requests_per_s']:>8.1f}"
            f"{r['errors'].get('TTFT_TIMEOUT', 0):>10}{r['cost_yuan_per_day']:>12,.0f}"
            f"{own.get('peak_in_flight', 0):>12.0f}/{own.get('mean_in_flight', 0):<6.1f}"
            f"{own.get('peak_waiting', 0):>11.0f}"
        )
    lines += [
        "",
        "TTFT in modelled ms; yuan/day by docs/mission.md's model at the hit rate; in flight"
        " and waiting: the pods' own gauges (running + waiting, vllm:num_requests_waiting),"
        " peak over pods and samples / mean per pod",
        "",
    ]
    lines.append("targets (as measured in this run)")
    lines += target_lines(report["targets"])
    lines.append(f"\nwall time {report['wall_s']:.0f} s")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """TTFT distributions (CDF, log x) of every policy, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 5.5), dpi=110)
    for name, values in report["ttft_samples_ms"].items():
        if not values:
            continue
        ordered = sorted(values)
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        axes.step(ordered, fractions, where="post", label=name, linewidth=1.6)
    axes.set_xscale("log")
    axes.set_xlabel("TTFT, modelled ms (log scale)")
    axes.set_ylabel("fraction of measured requests (timed out: at the timeout)")
    axes.axhline(0.99, color="grey", linestyle=":", linewidth=1)
    params = report["params"]
    axes.set_title(
        f"TTFT by routing policy: {params['pods']} emulated pods, {params['rate']:g} req/s, "
        f"{len(report['prefixes'])} prefixes"
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def write_outcomes(path: str, name: str, outcomes: Sequence[Any], trace: Sequence[Any]) -> None:
    """Append one JSON line per request of run `name`: what it asked and what it got."""
    with open(path, "a", encoding="utf-8") as out:
        for outcome, arrival in zip(outcomes, trace, strict=True):
            fields = dataclasses.asdict(outcome)
            line = {"run": name, "at": arrival.at} | {
                k: None if isinstance(v, float) and math.isnan(v) else v for k, v in fields.items()
            }
            out.write(json.dumps(line, allow_nan=False) + "\n")


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY=VALUE, e.g. load_factor=1.5")
    return name, value


def _counts(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(",") if part.strip())


SUMMARY = "routing policies side by side on one emulated fleet: hit rate, TTFT, load, cost"


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(bench_subparsers, "fleet", SUMMARY, __doc__)
    add = parser.add_argument
    add("--pods", type=positive_int, default=4, help="emulated pods (4)")
    add("--prefixes", type=positive_int, default=10, help="prefixes (10)")
    add("--zipf", type=float, default=1.2, help="Zipf exponent of prefix popularity (1.2)")
    add("--hot-tokens", type=positive_int, default=60_000)
    add("--tail-tokens", type=positive_int, default=12_000)
    add("--kv-tokens", type=positive_int, default=150_000, help="per pod")
    add("--rate", type=positive_float, default=40.0, help="req/s, modelled (40)")
    add("--duration", type=positive_float, default=60.0, help="modelled s (60)")
    add("--warmup", type=float, default=15.0, help="modelled s replayed but not measured (15)")
    add("--time-scale", type=positive_float, default=2.0, help="(2)")
    add("--max-tokens", type=positive_int, default=16)
    add(
        "--prefill-tps",
        type=positive_float,
        default=None,
        help="the pods' prefill tokens/s (default: the emulator's 16,000)",
    )
    add("--sidecars", type=positive_int, default=4, help="K processes (4)")
    add(
        "--also-sidecars",
        type=_counts,
        default=(),
        metavar="K,L",
        help="more runs with K, L... sidecar processes (e.g. 8)",
    )
    add(
        "--compare-signals",
        action="store_true",
        help="run every sidecar policy again with the pod load signals off (_nosig)",
    )
    add(
        "--compare-rules",
        action="store_true",
        help="run every sidecar policy again picking on own in-flight counts (_own) and with "
        "the saturation report (_sat) instead of the fleet view",
    )
    add(
        "--pod-sample-s",
        type=float,
        default=SAMPLE_INTERVAL_S,
        metavar="S",
        help=f"real seconds between reads of the pods' own gauges ({SAMPLE_INTERVAL_S}; 0: off)",
    )
    add(
        "--pod-load-header",
        action="store_true",
        help="the pods also send vLLM's load header on streams (vLLM: non-streaming only)",
    )
    add(
        "--first-token-timeout",
        type=positive_float,
        default=30.0,
        help="callers give up after this many modelled s without a token (30)",
    )
    add(
        "--base-port",
        type=int,
        default=0,
        help="pods on ports P..P+N-1 (0: free ports). The ring places prefixes by pod URL, "
        "so a fixed port gives the same placement every run",
    )
    add(
        "--home-budget",
        type=int,
        default=None,
        metavar="TOKENS",
        help="the sidecar's home_kv_budget_tokens (default: KV minus the in-flight reserve "
        "of this workload; 0: plain ring placement)",
    )
    add(
        "--home-balance",
        type=float,
        default=1.1,
        metavar="F",
        help="the sidecar's home_balance_factor (1.1; 0: off, the sidecar's default)",
    )
    add(
        "--policies",
        metavar="A,B",
        help="run only these, e.g. prefix_affinity,prefix_affinity_x4 (default: all six; "
        "a target is judged only when its policies ran)",
    )
    add("--seed", type=int, default=0)
    add(
        "--sidecar-set",
        action="append",
        default=[],
        type=_setting,
        metavar="KEY=VALUE",
        help="a config field for every sidecar process of the sidecar's runs, as serve's "
        "--set (repeatable), e.g. --sidecar-set load_poll_interval_s=0.25",
    )
    add(
        "--outcomes",
        metavar="FILE",
        help="write every request's outcome (policy, scheduled time, prefix, sidecar, pod, "
        "prompt and cached tokens, TTFT, error) to FILE as JSON lines, for tracing misses",
    )
    add("--quick", action="store_true", help="seconds, for tests: 2 pods, short trace")
    add_json_option(parser)
    add("--plot", metavar="FILE", help="write a PNG of the TTFT distributions")
    parser.set_defaults(func=run)


def _apply_quick(args: argparse.Namespace) -> None:
    args.pods, args.prefixes, args.sidecars = 2, 4, 2
    args.rate, args.duration, args.warmup = 10.0, 6.0, 1.0
    args.time_scale, args.first_token_timeout = 20.0, 20.0


def run(args: argparse.Namespace) -> int:
    if args.quick:
        _apply_quick(args)
    if args.hot_tokens + INPUT_TOKENS >= args.kv_tokens:
        print(
            f"prefix-sidecar bench fleet: --kv-tokens {args.kv_tokens} cannot hold the "
            f"{args.hot_tokens}-token hot prefix plus an input; raise it",
            file=sys.stderr,
        )
        return 2
    known = policy_names(argparse.Namespace(**{**vars(args), "policies": None}))
    unknown = set((args.policies or "").split(",")) - set(known) - {""}
    if unknown:
        print(
            f"prefix-sidecar bench fleet: --policies has {', '.join(sorted(unknown))}; "
            f"choose from {', '.join(known)}",
            file=sys.stderr,
        )
        return 2
    if not (args.home_balance == 0 or 1.0 <= args.home_balance < math.inf):
        print("prefix-sidecar bench fleet: --home-balance must be 0 or >= 1.0", file=sys.stderr)
        return 2
    if args.home_budget is not None and args.home_budget < 0:
        print("prefix-sidecar bench fleet: --home-budget must be >= 0", file=sys.stderr)
        return 2
    if not 0 <= args.warmup < args.duration:
        print("prefix-sidecar bench fleet: --warmup must be in [0, --duration)", file=sys.stderr)
        return 2

    report = run_and_report(
        "bench fleet", run_bench(args, progress_printer("bench fleet")), render, args.json
    )
    if report is None:
        return 130
    if args.plot:
        plot(report, args.plot)
        print(f"TTFT plot written to {args.plot}")
    return 0
