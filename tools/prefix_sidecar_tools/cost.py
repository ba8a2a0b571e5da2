"""`prefix-sidecar cost`: docs/mission.md's daily cost model, raw versus prefix-cached.

    raw    = N * ((T_prefix + T_user) * P_base + T_out * P_out) / 1e6
    cached = N * (T_prefix * ((1 - R) * P_base + R * P_cache) + T_user * P_base
                  + T_out * P_out) / 1e6
With docs/mission.md's numbers (20M requests/day, 60k-token prefix, 200 user and 500 output
tokens, 2.0/0.2/6.0 yuan per million tokens, R = 0.95): 2,468,000 vs 416,000 yuan/day,
83.1 % saved. docs/mission.md's introduction rounds this to 82.4 %; the formulas give 83.1 %.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class CostParams:
    requests_per_day: float = 20_000_000
    prefix_tokens: float = 60_000  # shared system context per request
    user_tokens: float = 200  # the merchant's own input
    output_tokens: float = 500
    price_base: float = 2.0  # yuan per million uncached input tokens
    price_cache: float = 0.2  # yuan per million cached input tokens
    price_out: float = 6.0  # yuan per million output tokens

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class CostReport:
    raw: float  # yuan/day without prefix caching
    cached: float  # yuan/day with the prefix cached at `hit_rate`
    saving: float  # raw - cached
    saving_pct: float  # 100 * saving / raw
    hit_rate: float


def daily_cost(params: CostParams, hit_rate: float) -> CostReport:
    """docs/mission.md's two formulas; hit_rate is the fraction of prefix tokens served cached."""
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate must be within [0, 1], got {hit_rate}")
    params.validate()
    p = params
    per_million = 1e6
    output = p.output_tokens * p.price_out
    raw_per_req = ((p.prefix_tokens + p.user_tokens) * p.price_base + output) / per_million
    prefix_price = (1.0 - hit_rate) * p.price_base + hit_rate * p.price_cache
    cached_per_req = (
        p.prefix_tokens * prefix_price + p.user_tokens * p.price_base + output
    ) / per_million
    raw = p.requests_per_day * raw_per_req
    cached = p.requests_per_day * cached_per_req
    saving = raw - cached
    return CostReport(
        raw=raw,
        cached=cached,
        saving=saving,
        saving_pct=100.0 * saving / raw if raw else 0.0,
        hit_rate=hit_rate,
    )


_FLAGS = [
    ("--requests-per-day", "requests_per_day", "requests per day"),
    ("--prefix-tokens", "prefix_tokens", "shared prefix tokens per request"),
    ("--user-tokens", "user_tokens", "user input tokens per request"),
    ("--output-tokens", "output_tokens", "output tokens per request"),
    ("--price-base", "price_base", "yuan per million uncached input tokens"),
    ("--price-cache", "price_cache", "yuan per million cached input tokens"),
    ("--price-out", "price_out", "yuan per million output tokens"),
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cost",
        help="daily cost with and without prefix caching (docs/mission.md's model)",
        description="Daily cost of docs/mission.md's workload, raw versus prefix-cached.",
    )
    defaults = CostParams()
    for flag, attr, text in _FLAGS:
        default = getattr(defaults, attr)
        parser.add_argument(
            flag, dest=attr, type=float, default=default, help=f"{text} ({default:g})"
        )
    parser.add_argument(
        "--hit-rate",
        type=float,
        default=0.95,
        help="fraction of prefix tokens served from cache, 0..1 (0.95)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params = CostParams(**{attr: getattr(args, attr) for _, attr, _ in _FLAGS})
    try:
        report = daily_cost(params, args.hit_rate)
    except ValueError as exc:
        print(f"prefix-sidecar cost: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {"params": dataclasses.asdict(params), **dataclasses.asdict(report)}, indent=2
            )
        )
        return 0
    print(
        f"requests/day {params.requests_per_day:,.0f}; per request {params.prefix_tokens:,.0f} "
        f"prefix + {params.user_tokens:,.0f} user -> {params.output_tokens:,.0f} output tokens"
    )
    print(f"raw (no cache)        {report.raw:>14,.0f} yuan/day")
    print(f"cached (hit {100 * report.hit_rate:.1f} %)  {report.cached:>14,.0f} yuan/day")
    print(f"saving                {report.saving:>14,.0f} yuan/day = {report.saving_pct:.1f} %")
    return 0
