"""`bench organic --seeds`: the same bench on several seeded traces, its TTFTs pooled.

One trace's p99 is about its 5 slowest of ~460 measured requests. The queue model
(organic_ttft_precise) shows what that is worth: changing one routing rule moves one seed's
p99 by up to +-100 ms and another's the other way, and the ranking of two routers differs
from seed to seed (precise 339 against cache_aware's 323 ms on seed 0, 273 against 424 on
seed 4). Pooling the measured requests of K traces puts about 5 x K requests in the top
1 %, so a p99 compares routers rather than one trace's few worst moments. Each seed is a whole
`bench organic` run (its own fleet, trace and report, kept under "seeds"); "pooled" has,
per path and policy, the TTFT percentiles of every seed's measured requests together.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from prefix_sidecar_tools.bench.organic_targets import (
    TARGET_PRECISE_FRACTION,
    precise_policies,
    sglang_p99_target,
)
from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.report import target_lines

POOLED_PERCENTILES = (50, 95, 99)


def seed_list(text: str) -> list[int]:
    """`0,1,2` or `0-5`: distinct whole numbers, at least two."""
    try:
        if "-" in text.strip("-"):
            low, _, high = text.partition("-")
            seeds = list(range(int(low), int(high) + 1))
        else:
            seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are '0,1,2' or '0-5', got {text!r}") from None
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"give at least two distinct seeds, got {text!r}")
    return seeds


def pooled(reports: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per path and policy, over every report: the measured TTFTs' percentiles, the
    requests behind them, and each report's own p99 (in the reports' order)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for path, runs in reports[0]["paths"].items():
        out[path] = {}
        for name in runs:
            each = [report["paths"][path][name]["ttft_ms"] for report in reports]
            values = [value for ttft in each for value in ttft["values"]]
            row: dict[str, Any] = {f"p{q}": percentile(values, q) for q in POOLED_PERCENTILES}
            row["requests"] = len(values)
            row["p99_each"] = [ttft["p99"] for ttft in each]
            row["fraction_each"] = [report["paths"][path][name]["fraction"] for report in reports]
            out[path][name] = row
    return out


async def run_seeds(
    args: argparse.Namespace,
    one_run: Callable[[argparse.Namespace], Coroutine[Any, Any, dict[str, Any]]],
) -> dict[str, Any]:
    """`one_run` (bench organic's whole run) once per seed of args.seeds, then pooled."""
    reports = []
    for seed in args.seeds:
        reports.append(await one_run(argparse.Namespace(**{**vars(args), "seed": seed})))
    rows = pooled(reports)
    return {
        "seeds": {str(seed): report for seed, report in zip(args.seeds, reports, strict=True)},
        "pooled": rows,
        "targets": pooled_targets(rows, reports[0]["params"]["sidecars"]),
        "wall_s": sum(report["wall_s"] for report in reports),
    }


def pooled_targets(rows: dict[str, dict[str, dict[str, Any]]], k: int) -> list[dict[str, Any]]:
    """Precise routing's targets over the seeds: every seed's hit, and one sidecar's TTFT p99
    of the pooled requests against SGLang's router's (organic_targets has one trace's)."""
    targets: list[dict[str, Any]] = []
    for path, runs in rows.items():
        for name in precise_policies(k):
            if name in runs:
                each = runs[name]["fraction_each"]
                targets.append(
                    {
                        "name": f"{path} {name}: hit >= {TARGET_PRECISE_FRACTION} of the "
                        "ceiling on every seed",
                        "measured": " ".join(f"{fraction:.3f}" for fraction in each),
                        "met": min(each) >= TARGET_PRECISE_FRACTION,
                    }
                )
        if "precise" in runs and "sglang" in runs:
            ours, theirs = runs["precise"]["p99"], runs["sglang"]["p99"]
            targets.append(sglang_p99_target(path, ours, theirs, " over the seeds"))
    return targets


def render_pooled(report: dict[str, Any]) -> str:
    seeds = list(report["seeds"])
    lines = [
        f"bench organic over seeds {', '.join(seeds)}: TTFT (modelled ms) of every seed's "
        "measured requests together, and each seed's own p99 and hit (of its ceiling)",
        "",
        f"{'path':<14}{'policy':<14}{'requests':>9}{'p50':>8}{'p95':>8}{'p99':>8}   "
        "p99 per seed / hit per seed",
    ]
    for path, runs in report["pooled"].items():
        for name, row in runs.items():
            each = " ".join(f"{p99:,.0f}" for p99 in row["p99_each"])
            hits = " ".join(f"{fraction:.3f}" for fraction in row["fraction_each"])
            lines.append(
                f"{path:<14}{name:<14}{row['requests']:>9}{row['p50']:>8,.0f}{row['p95']:>8,.0f}"
                f"{row['p99']:>8,.0f}   {each} / {hits}"
            )
    if report.get("targets"):
        lines += ["", "targets (pooled over the seeds)", *target_lines(report["targets"])]
    lines.append(f"\nwall time {report['wall_s']:.0f} s")
    return "\n".join(lines)
