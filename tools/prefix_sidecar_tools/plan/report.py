"""The plan, side by side: no cache against the sidecar (text and JSON)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from prefix_sidecar_tools.plan.capacity import Column
from prefix_sidecar_tools.plan.scenario import Scenario


def _ms(value: float) -> str:
    return "unstable" if not math.isfinite(value) else f"{value:,.0f} ms"


def _replicas(column: Column) -> str:
    if not column.replicas:
        return "- (nothing cached)"
    shown = ", ".join(f"{name} x{count}" for name, count in list(column.replicas.items())[:4])
    return shown + (" ..." if len(column.replicas) > 4 else "")


ROWS = [
    ("binding", lambda c: c.binding),
    ("TTFT p99 SLO", lambda c: f"{c.slo_ms:,.0f} ms"),
    ("max req/s per pod at SLO", lambda c: f"{c.rate_per_pod:,.2f}"),
    ("pods", lambda c: f"{c.pods:,}"),
    ("GPUs", lambda c: f"{c.gpus:,}"),
    ("QPS per GPU", lambda c: f"{c.qps_per_gpu:,.2f}"),
    ("load per pod at peak", lambda c: f"{c.load_per_pod:,.2f} req/s"),
    ("TTFT p50 at peak", lambda c: _ms(c.p50_ms)),
    ("TTFT p99 at peak", lambda c: _ms(c.p99_ms)),
    ("prefix-token hit rate", lambda c: f"{100 * c.hit_rate:.1f} %"),
    ("replicas per prefix", _replicas),
    ("running per pod (limit)", lambda c: f"{c.running_limit:,}"),
    ("yuan/day", lambda c: f"{c.yuan_per_day:,.0f}"),
]


def render(scenario: Scenario, columns: list[Column]) -> str:
    t, pod = scenario.traffic, scenario.pod
    mix = ", ".join(f"{p.name} {p.tokens:,} tok x{p.share:g}" for p in t.prefixes[:4])
    lines = [
        f"prefix-sidecar plan ({scenario.name}): peak {t.peak_rps:,.0f} req/s; prefixes {mix}"
        + (" ..." if len(t.prefixes) > 4 else "")
        + f"; {t.query_tokens} query + {t.output_tokens} output tokens",
        f"pod: {pod.gpus} GPU, prefill {pod.prefill_tps:,.0f} tok/s x {pod.prefill_slots} "
        f"slot(s) + {pod.prefill_overhead_ms:g} ms, decode {pod.decode_tps:g} tok/s/stream, "
        f"max running {pod.max_running}, KV {pod.kv_tokens:,} tokens"
        + (f", +{pod.overhead_ms:g} ms outside the pod" if pod.overhead_ms else ""),
        f"routing: hit rate {100 * scenario.token_hit_rate():.1f} % of prefix tokens "
        f"({scenario.routing.miss} misses; from {scenario.routing.source})",
        "model: M/G/c per pod (prefill is the service, FIFO), behind a FIFO limit on running "
        "requests; docs/plan.md",
        "",
    ]
    width = max(len(name) for name, _ in ROWS) + 2
    lines.append(f"{'':<{width}}" + "".join(f"{c.kind:>24}" for c in columns))
    for name, value in ROWS:
        lines.append(f"{name:<{width}}" + "".join(f"{value(c):>24}" for c in columns))
    limits = "; ".join(
        f"{c.kind}: " + ", ".join(f"{k} {v:,.1f}" for k, v in c.limits.items()) for c in columns
    )
    lines += ["", f"saturation req/s per pod ({limits})"]
    for c in columns:
        lines += [f"note ({c.kind}): {n}" for n in c.notes]
    if len(columns) == 2 and columns[1].gpus:
        a, b = columns
        lines.append(
            f"{b.kind} vs {a.kind}: {a.gpus / b.gpus:,.1f}x fewer GPUs, TTFT p99 "
            f"{a.p99_ms / b.p99_ms:,.1f}x lower, "
            f"{100 * (1 - b.yuan_per_day / a.yuan_per_day):.1f} % less per day"
        )
    return "\n".join(lines)


def to_json(scenario: Scenario, columns: list[Column]) -> dict[str, Any]:
    return {
        "scenario": dataclasses.asdict(scenario),
        "token_hit_rate": scenario.token_hit_rate(),
        "columns": [{**dataclasses.asdict(c), "qps_per_gpu": c.qps_per_gpu} for c in columns],
    }
