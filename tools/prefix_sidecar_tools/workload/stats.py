"""Turn request outcomes into the numbers the demo and the fleet bench report.

Definitions (docs/benchmarks.md):
- prefix-token hit rate = sum over answered requests of min(cached_tokens, prefix_tokens)
  / sum of prefix_tokens, with cached_tokens as the pod reported it in the usage of the
  stream. The min() keeps cache hits inside the merchant's input out of the figure.
- TTFT is measured by the caller from the scheduled send to the first chunk, in real
  seconds, and reported in MODELLED milliseconds (real x time scale), the emulator's clock.
- load = requests per pod over the run; max/mean is over every pod of the fleet.
- requests per second = answered requests / (last answer - first send), modelled seconds.
- cost per day: docs/mission.md's model (prefix_sidecar_tools/cost.py) at the measured hit rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from prefix_sidecar_tools.cost import CostParams, daily_cost
from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.workload.driver import TIMEOUT, Outcome


def hit_rate(outcomes: Sequence[Outcome], prefix_tokens: Sequence[int]) -> float:
    answered = [o for o in outcomes if o.ok]
    total = sum(prefix_tokens[o.prefix] for o in answered)
    cached = sum(min(o.cached_tokens, prefix_tokens[o.prefix]) for o in answered)
    return cached / total if total else 0.0


def pod_loads(outcomes: Sequence[Outcome], pods: Sequence[str]) -> dict[str, int]:
    loads = dict.fromkeys(pods, 0)
    for outcome in outcomes:
        if outcome.backend:
            loads[outcome.backend] = loads.get(outcome.backend, 0) + 1
    return loads


def summarize(
    outcomes: Sequence[Outcome],
    prefix_tokens: Sequence[int],
    pods: Sequence[str],
    time_scale: float,
    *,
    first_token_timeout_s: float = math.inf,
    loads: dict[str, int] | None = None,
    cost: CostParams | None = None,
) -> dict[str, Any]:
    """The per-policy report: hit rate, TTFT, load balance, throughput, cost.

    Requests that timed out waiting for their first token count in the TTFT percentiles
    at the timeout (censored: the true value is larger), so an overloaded policy cannot
    look fast by dropping its slowest requests; `ttft_ms.lower_bound` says when p99 is
    such a censored value. `loads` (requests per pod) defaults to the answered requests'
    backends; the fleet bench passes the pods' own request counters instead.
    """
    answered = [o for o in outcomes if o.ok]
    timeouts = [o for o in outcomes if o.error == TIMEOUT]
    censored_ms = first_token_timeout_s * time_scale * 1e3
    ttft_ms = [o.ttft_s * time_scale * 1e3 for o in answered] + [censored_ms] * len(timeouts)
    loads = dict(loads) if loads is not None else pod_loads(answered, pods)
    mean_load = sum(loads.values()) / len(loads) if loads else 0.0
    rate = hit_rate(outcomes, prefix_tokens)
    if answered:
        span = max(o.sent_at + o.total_s for o in answered) - min(o.sent_at for o in outcomes)
    else:
        span = 0.0
    report = daily_cost(cost or CostParams(), rate)
    errors: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.error:
            key = outcome.error.split(":", 1)[0]
            errors[key] = errors.get(key, 0) + 1
    p99 = percentile(ttft_ms, 99)
    return {
        "requests": len(outcomes),
        "answered": len(answered),
        "errors": errors,
        "hit_rate": rate,
        "ttft_ms": {
            "p50": percentile(ttft_ms, 50),
            "p90": percentile(ttft_ms, 90),
            "p99": p99,
            "max": max(ttft_ms) if ttft_ms else math.nan,
            "lower_bound": bool(timeouts) and p99 >= censored_ms,
        },
        "load": {
            "per_pod": loads,
            "max_over_mean": max(loads.values()) / mean_load if mean_load else math.nan,
        },
        "requests_per_s": len(answered) / (span * time_scale) if span > 0 else math.nan,
        "cost_yuan_per_day": report.cached,
        "cost_raw_yuan_per_day": report.raw,
        "saving_pct": report.saving_pct,
    }


def ttft_samples_ms(outcomes: Sequence[Outcome], time_scale: float) -> list[float]:
    return [o.ttft_s * time_scale * 1e3 for o in outcomes if o.ok]
