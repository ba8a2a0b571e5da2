"""`prefix-sidecar plan`: how many GPUs, what TTFT and what bill, for your traffic.

Every input is a flag; `--scenario FILE` (YAML) gives a whole scenario, `--preset note`
docs/mission.md's load-test table; flags override both. Output: no cache and the sidecar
side by side (docs/plan.md). Impossible scenarios exit 2 saying what and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from prefix_sidecar_tools.plan import capacity, report
from prefix_sidecar_tools.plan.presets import PRESETS
from prefix_sidecar_tools.plan.scenario import (
    MISS_MODELS,
    Prefix,
    Scenario,
    ScenarioError,
    load_yaml,
    validate,
)
from prefix_sidecar_tools.report import add_command

# flag -> (section, field, type, help)
_FLAGS: list[tuple[str, str, str, type, str]] = [
    ("--peak-rps", "traffic", "peak_rps", float, "peak requests per second"),
    ("--query-tokens", "traffic", "query_tokens", int, "tokens of each request's own input"),
    ("--output-tokens", "traffic", "output_tokens", int, "output tokens per request"),
    ("--slo-ms", "traffic", "slo_ms", float, "TTFT p99 SLO, ms"),
    ("--no-cache-slo-ms", "traffic", "no_cache_slo_ms", float, "the no-cache column's SLO"),
    ("--requests-per-day", "traffic", "requests_per_day", float, "for the daily bill"),
    ("--prefill-tps", "pod", "prefill_tps", float, "prefill tokens/s per prefill slot"),
    ("--prefill-overhead-ms", "pod", "prefill_overhead_ms", float, "fixed ms per prefill"),
    ("--prefill-slots", "pod", "prefill_slots", int, "prefills computed at once per pod"),
    ("--decode-tps", "pod", "decode_tps", float, "decode tokens/s per stream"),
    ("--max-running", "pod", "max_running", int, "running requests per pod"),
    ("--kv-tokens", "pod", "kv_tokens", int, "KV cache tokens per pod"),
    ("--gpus-per-pod", "pod", "gpus", int, "GPUs per pod"),
    ("--overhead-ms", "pod", "overhead_ms", float, "ms added to TTFT outside the pod"),
    ("--hit-rate", "routing", "hit_rate", float, "prefix-token hit rate, 0..1"),
    ("--price-base", "prices", "price_base", float, "yuan per M uncached input tokens"),
    ("--price-cache", "prices", "price_cache", float, "yuan per M cached input tokens"),
    ("--price-out", "prices", "price_out", float, "yuan per M output tokens"),
]


def _prefix(text: str) -> Prefix:
    """NAME:TOKENS:SHARE[:HIT]"""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise argparse.ArgumentTypeError(f"--prefix wants NAME:TOKENS:SHARE[:HIT], got {text!r}")
    try:
        return Prefix(
            parts[0],
            int(parts[1]),
            float(parts[2]),
            float(parts[3]) if len(parts) == 4 else None,
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prefix {text!r}: TOKENS, SHARE, HIT are numbers"
        ) from None


SUMMARY = "GPUs, TTFT and yuan/day for your traffic: no cache vs the sidecar"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "plan", SUMMARY, __doc__)
    add = parser.add_argument
    add("--preset", choices=sorted(PRESETS), help="a whole scenario (note: docs/mission.md's)")
    add("--scenario", metavar="FILE", help="a YAML scenario (docs/plan.md); flags override it")
    add(
        "--prefix",
        action="append",
        type=_prefix,
        metavar="NAME:TOKENS:SHARE[:HIT]",
        help="one prefix of the mix (repeat); shares must sum to 1",
    )
    add("--prefix-tokens", type=int, help="one prefix on every request, of this many tokens")
    for flag, _, attr, kind, text in _FLAGS:
        add(flag, dest=attr, type=kind, default=None, help=text)
    add("--miss", choices=MISS_MODELS, help="whole: a miss recomputes the prefix; partial: a part")
    add(
        "--from-emulator",
        metavar="FLAGS",
        help='pod model from emulator flags, e.g. "--kv-tokens 150000"',
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--from-metrics",
        metavar="URL",
        help="hit rate from a sidecar's /metrics; KV budget and hit rate from a vLLM pod's",
    )
    source.add_argument(
        "--measure", action="store_true", help="hit rate and replicas from the real routing core"
    )
    add("--samples", type=int, default=40_000, help="simulated requests per queue evaluation")
    add("--plot", metavar="FILE", help="write a PNG of GPUs and TTFT p99 against the hit rate")
    add("--json", action="store_true", help="print JSON instead of the table")
    parser.set_defaults(func=run)


def build_scenario(args: argparse.Namespace) -> Scenario:
    scenario = PRESETS[args.preset] if args.preset else Scenario()
    if args.scenario:
        try:
            text = Path(args.scenario).read_text(encoding="utf-8")
        except OSError as exc:
            raise ScenarioError(f"cannot read {args.scenario}: {exc.strerror}") from None
        scenario = load_yaml(text, scenario)
    sections: dict[str, dict[str, Any]] = {}
    for _, section, attr, _, _ in _FLAGS:
        value = getattr(args, attr)
        if value is not None:
            sections.setdefault(section, {})[attr] = value
    if args.prefix and args.prefix_tokens is not None:
        raise ScenarioError("give either --prefix (a mix) or --prefix-tokens (one prefix)")
    if args.prefix:
        sections.setdefault("traffic", {})["prefixes"] = tuple(args.prefix)
    elif args.prefix_tokens is not None:
        sections.setdefault("traffic", {})["prefixes"] = (
            Prefix("prefix", args.prefix_tokens, 1.0),
        )
    if args.miss:
        sections.setdefault("routing", {})["miss"] = args.miss
    if args.from_emulator is not None:
        from prefix_sidecar_tools.plan.emulator_model import pod_from_emulator_flags

        pod = pod_from_emulator_flags(args.from_emulator)
        scenario = dataclasses.replace(scenario, pod=pod)
    changes = {
        name: dataclasses.replace(getattr(scenario, name), **values)
        for name, values in sections.items()
    }
    scenario = dataclasses.replace(scenario, **changes)
    validate(scenario)
    return scenario


def plan(
    scenario: Scenario, *, measure: bool = False, samples: int = 40_000
) -> tuple[Scenario, list[capacity.Column]]:
    """Both columns; with `measure`, the sidecar's hit rate and replicas come from the
    routing core run over the fleet the first pass sized."""
    sidecar = capacity.plan_column(scenario, capacity.SIDECAR, samples=samples)
    no_cache = plan_no_cache(scenario, samples)
    if measure:
        from prefix_sidecar_tools.plan.measure import measure as run_measure

        measured = run_measure(scenario, sidecar.pods, sidecar.replicas)
        scenario = scenario.with_hit_rates(
            measured.hit_rates,
            measured.token_hit_rate,
            f"--measure: routing core, {sidecar.pods} pods, {len(measured.ttfts_s):,} requests, "
            f"max/mean load {measured.max_over_mean:.2f}",
        )
        # a routed request finds its prefix resident or not: whole misses
        scenario = dataclasses.replace(
            scenario, routing=dataclasses.replace(scenario.routing, miss="whole")
        )
        first_pods = sidecar.pods
        sidecar = capacity.plan_column(
            scenario, capacity.SIDECAR, replicas=measured.replicas, samples=samples
        )
        sidecar.notes.append(
            f"fleet model (the real router feeding each pod's queue, {first_pods} pods at the "
            f"peak): TTFT p50 {measured.p(50) * 1e3:,.0f} ms, p99 {measured.p(99) * 1e3:,.0f} "
            f"ms, max/mean load {measured.max_over_mean:.2f}"
        )
    return scenario, [no_cache, sidecar]


def plan_no_cache(scenario: Scenario, samples: int) -> capacity.Column:
    """The no-cache column at its SLO. When no fleet can meet it (a cold prefill alone is
    slower), it gets the same slack over its idle p99 as the SLO gives the sidecar column
    (SLO / the sidecar's idle p99), and the report says so."""
    try:
        return capacity.plan_column(scenario, capacity.NO_CACHE, samples=samples)
    except capacity.Unreachable:
        if scenario.traffic.no_cache_slo_ms is not None:
            raise
    idle = capacity.idle_p99_ms(scenario, capacity.NO_CACHE)
    slack = scenario.traffic.slo_ms / capacity.idle_p99_ms(scenario, capacity.SIDECAR)
    relaxed = dataclasses.replace(
        scenario,
        traffic=dataclasses.replace(scenario.traffic, no_cache_slo_ms=slack * idle),
    )
    column = capacity.plan_column(relaxed, capacity.NO_CACHE, samples=samples)
    column.notes.append(
        f"no fleet meets {scenario.traffic.slo_ms:,.0f} ms without a cache (an idle pod's p99 "
        f"is {idle:,.0f} ms); sized to {slack:.2f} x that, the slack the SLO gives the sidecar "
        f"column over its idle p99 (--no-cache-slo-ms sets it)"
    )
    return column


def run(args: argparse.Namespace) -> int:
    try:
        scenario = build_scenario(args)
        if args.from_metrics:
            from prefix_sidecar_tools.plan.from_metrics import apply

            scenario = apply(scenario, args.from_metrics)
        if args.samples < 1_000 or args.samples > 2_000_000:
            raise ScenarioError("--samples must be within [1000, 2000000]")
        scenario, columns = plan(scenario, measure=args.measure, samples=args.samples)
    except ScenarioError as exc:
        print(f"prefix-sidecar plan: impossible: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(scenario, columns), indent=1, default=str))
    else:
        print(report.render(scenario, columns))
    if args.plot:
        from prefix_sidecar_tools.plan.plot import plot

        plot(scenario, args.plot, samples=min(args.samples, 20_000))
        print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
