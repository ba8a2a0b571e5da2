"""The numbers of `bench organic`: one row per (path, policy) run, fractions of the ceiling.

Definitions (docs/benchmarks.md, "Organic traffic"):
- hit rate = sum of the pods' usage.prompt_tokens_details.cached_tokens over answered
  requests / sum of prompt tokens over ALL requests of the trace (a failed request caches
  nothing); by class the same sums over that class's requests;
- ceiling = the oracle's cached tokens / the same prompt tokens (organic_oracle);
  fraction = hit rate / ceiling, whole run and per class;
- TTFT: send -> first chunk, modelled ms (real x time scale); timeouts count at the timeout;
  the percentiles cover the requests sent after the warm-up (every run starts with empty
  caches and a burst of first sights whose cold prefills every policy pays alike), the
  whole run's are kept as ttft_ms_all;
- load: requests each pod received (its own counter), max/mean over pods; in-flight: each
  pod's running requests sampled during the run, max/mean of the per-pod means;
- decision: the sidecars' decision histogram (bucket upper bounds, so "<= x us"), or the
  central router's own timings (exact).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from prefix_sidecar_tools.bench.organic_driver import TIMEOUT, Result
from prefix_sidecar_tools.bench.organic_oracle import Ceiling
from prefix_sidecar_tools.bench.organic_trace import CLASSES
from prefix_sidecar_tools.percentile import percentile


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


def summarize(
    results: Sequence[Result],
    ceilings: Sequence[Ceiling],
    *,
    time_scale: float,
    timeout_s: float,
    pod_requests: dict[str, int],
    in_flight: dict[str, float],
    decision_us: dict[str, Any],
    previous_turn: Sequence[int] = (),
    warmup_s: float = 0.0,
    counted: Sequence[bool] | None = None,
) -> dict[str, Any]:
    """`previous_turn[seq]`: the seq of the same session's previous turn, or -1.
    `counted[seq]`: whether the request is measured (a steady state's window: requests
    before it were sent and cached but count nowhere; loads then come from the backends the
    answers named, not the pods' counters)."""
    every, by_seq = results, ceilings
    if counted is not None:
        pairs = [(r, c) for r, c, keep in zip(results, ceilings, counted, strict=True) if keep]
        results, ceilings = [r for r, _ in pairs], [c for _, c in pairs]
        pod_requests = dict.fromkeys(pod_requests, 0)
        for r in results:
            if r.backend in pod_requests:
                pod_requests[r.backend] += 1
    prompt = sum(c.prompt_tokens for c in ceilings)
    ceiling_hit = _ratio(sum(c.cached_tokens for c in ceilings), prompt)
    hit = _ratio(sum(r.cached_tokens for r in results if r.ok), prompt)
    classes: dict[str, dict[str, float]] = {}
    for kind in CLASSES:
        mine = [(r, c) for r, c in zip(results, ceilings, strict=True) if r.kind == kind]
        tokens = sum(c.prompt_tokens for _, c in mine)
        ceiling = _ratio(sum(c.cached_tokens for _, c in mine), tokens)
        measured = _ratio(sum(r.cached_tokens for r, _ in mine if r.ok), tokens)
        classes[kind] = {
            "requests": len(mine),
            "hit_rate": measured,
            "ceiling": ceiling,
            "fraction": _ratio(measured, ceiling),
        }
    answered = [r for r in results if r.ok]
    after_warmup = [r for r in results if r.sent_at * time_scale >= warmup_s]
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            key = r.error.split(":", 1)[0]
            errors[key] = errors.get(key, 0) + 1
    mismatched = sum(
        1
        for r, c in zip(results, ceilings, strict=True)
        if r.ok and r.prompt_tokens != c.prompt_tokens
    )
    followed = [
        (every[previous_turn[r.seq]], r)
        for r in results
        if r.seq < len(previous_turn)
        and previous_turn[r.seq] >= 0
        and r.ok
        and every[previous_turn[r.seq]].ok
        and r.backend  # a central router that does not say which pod answered: unknown
    ]
    moved = sum(1 for before, r in followed if before.backend != r.backend)
    loads = list(pod_requests.values())
    flights = list(in_flight.values())
    mean_load = sum(loads) / len(loads) if loads else 0.0
    mean_flight = sum(flights) / len(flights) if flights else 0.0
    return {
        "requests": len(results),
        "answered": len(answered),
        "errors": errors,
        "prompt_tokens_mismatched": mismatched,
        "hit_rate": hit,
        "ceiling": ceiling_hit,
        "fraction": _ratio(hit, ceiling_hit),
        "classes": classes,
        # session turns answered by another pod than the turn before (both answered)
        "session_turns_moved": _ratio(moved, len(followed)),
        "ttft_ms": _ttft(after_warmup, time_scale, timeout_s),
        "ttft_ms_all": _ttft(results, time_scale, timeout_s),  # every counted request
        "load": {
            "per_pod": pod_requests,
            "max_over_mean": _ratio(max(loads), mean_load) if loads else math.nan,
            "in_flight_per_pod": in_flight,
            "in_flight_max_over_mean": _ratio(max(flights), mean_flight) if flights else math.nan,
        },
        "decision_us": decision_us,
        # what the tail is made of: the slowest 1 % (at least 3) of the answered requests
        "slowest": [
            {
                "seq": r.seq,
                "kind": r.kind,
                "backend": r.backend,
                "ttft_ms": r.ttft_s * time_scale * 1e3,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "ceiling_tokens": by_seq[r.seq].cached_tokens,
            }
            for r in sorted(answered, key=lambda r: r.ttft_s, reverse=True)[
                : max(3, len(answered) // 100)
            ]
        ],
    }


def _ttft(results: Sequence[Result], time_scale: float, timeout_s: float) -> dict[str, Any]:
    censored = timeout_s * time_scale * 1e3
    timeouts = sum(1 for r in results if r.error == TIMEOUT)
    values = [r.ttft_s * time_scale * 1e3 for r in results if r.ok] + [censored] * timeouts
    p99 = percentile(values, 99)
    return {
        "requests": len(values),
        "p50": percentile(values, 50),
        "p99": p99,
        "lower_bound": timeouts > 0 and p99 >= censored,
        "values": sorted(round(value, 1) for value in values),  # for pooling over seeds
    }


def exact_decision_us(samples_ns: Sequence[int]) -> dict[str, Any]:
    return {
        "p50": percentile(samples_ns, 50) / 1e3 if samples_ns else math.nan,
        "p99": percentile(samples_ns, 99) / 1e3 if samples_ns else math.nan,
        "bucketed": False,
    }


def _ratio_text(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def _us(value: float, decision: dict[str, Any]) -> str:
    if math.isnan(value):
        return "-"
    if math.isinf(value):  # beyond the histogram's last finite bucket
        return f">{decision.get('top_bucket_us', 0):.0f}"
    text = f"{value:.0f}" if value >= 10 else f"{value:.1f}"
    return ("<=" if decision["bucketed"] else "") + text


def _percentages(counts: dict[str, int]) -> str:
    total = sum(counts.values()) or 1
    return ", ".join(f"{key} {100 * count / total:.1f} %" for key, count in counts.items())


def _organic_decision_lines(report: dict[str, Any]) -> list[str]:
    """How the sidecars' organic decisions went, per run that made any (their own counts,
    prefix_sidecar_organic_decisions_total, whole run): starts sent past the session set
    are what balance costs in cold heads; then how bounded load picked (home or spill, every
    request) and the failovers, which move a request too."""
    lines = []
    for path, runs in report["paths"].items():
        for name, run in runs.items():
            kinds = run.get("organic_decisions")
            if not kinds or run.get("same_run_as"):
                continue
            lines.append(f"  {path} {name}: {_percentages(kinds)}")
            if run.get("picks"):  # what bounded load then did with them (every request)
                lines.append(
                    f"  {'':<{len(path)}} {'':<{len(name)}}  picks: {_percentages(run['picks'])}"
                )
            if run.get("precise"):  # what precise routing did with them
                lines.append(
                    f"  {'':<{len(path)}} {'':<{len(name)}}  precise: "
                    f"{_percentages(run['precise'])}"
                )
            if run.get("failovers"):
                moved = ", ".join(f"{reason} {count}" for reason, count in run["failovers"].items())
                lines.append(f"  {'':<{len(path)}} {'':<{len(name)}}  failovers: {moved}")
    if lines:
        lines.insert(0, "organic decisions (the sidecars' counts, whole run):")
        lines.insert(0, "")
    return lines


def render(report: dict[str, Any]) -> str:
    params = report["params"]
    trace = report["trace"]
    classes = ", ".join(f"{k} {v}" for k, v in trace["classes"].items())
    lines = [
        f"prefix-sidecar bench organic: {params['pods']} pods (KV {params['kv_tokens']:,} "
        f"tokens each), {trace['requests']} requests ({classes}), "
        f"time x{params['time_scale']:g}, seed {params['seed']}"
        + ("  [--quick]" if params["quick"] else "")
        + (
            "  [--pin-flows: a flow's requests through one sidecar]"
            if params.get("pin_flows")
            else ""
        ),
        f"pod: prefill {params['prefill_tps']:,.0f} tokens/s, mean prefill utilisation at the "
        f"ceiling {100 * report['utilisation_at_ceiling']:.0f} %; distinct prompt tokens "
        f"{report['distinct_prompt_tokens']:,} vs {params['pods'] * params['kv_tokens']:,} of KV",
        f"oracle ceiling: {report['ceiling']['hit_rate']:.4f} ("
        + ", ".join(f"{k} {v:.4f}" for k, v in report["ceiling"]["classes"].items())
        + ")",
        f"sidecar default for unregistered prompts: {report['sidecar_scheme']}",
    ]
    after = params.get("measure_after", 0.0)
    if after:
        any_run = next(iter(next(iter(report["paths"].values()), {}).values()), None)
        counted = f"{any_run['requests']} of {trace['requests']}" if any_run else "the"
        lines.append(
            f"steady state: {counted} requests measured, those due after {after:g} modelled s "
            "(the earlier ones were sent and cached, and the sidecars learnt from them)"
        )
    floor = report.get("ttft_floor_ms")
    if floor:
        lines.append(
            f"TTFT floor (every request at the ceiling's hits, no queue, prefill only): "
            f"p50 {floor['p50']:,.0f} ms, p99 {floor['p99']:,.0f} ms"
        )
    lines.append("")
    header = (
        f"{'path':<14}{'policy':<14}{'hit':>7}{'/ceil':>7}{'tenant':>8}{'session':>8}"
        f"{'fewshot':>8}{'p50 ms':>8}{'p99 ms':>9}{'max/mean':>9}{'flight':>7}"
        f"{'dec p50':>9}{'dec p99':>9}{'moved':>7}{'err':>5}"
    )
    lines.append(header)
    for path, runs in report["paths"].items():
        for name, r in runs.items():
            c = r["classes"]
            d = r["decision_us"]
            p99 = (">" if r["ttft_ms"]["lower_bound"] else "") + f"{r['ttft_ms']['p99']:,.0f}"
            shown = name + ("*" if "same_run_as" in r else "")
            lines.append(
                f"{path:<14}{shown:<14}{r['hit_rate']:>7.4f}{r['fraction']:>7.3f}"
                f"{c['tenant']['fraction']:>8.3f}{c['session']['fraction']:>8.3f}"
                f"{c['fewshot']['fraction']:>8.3f}{r['ttft_ms']['p50']:>8,.0f}{p99:>9}"
                f"{r['load']['max_over_mean']:>9.2f}{_ratio_text(r['load']['in_flight_max_over_mean']):>7}"
                f"{_us(d['p50'], d):>9}{_us(d['p99'], d):>9}"
                f"{_ratio_text(r['session_turns_moved']):>7}"
                f"{sum(r['errors'].values()):>5}"
            )
    lines += [
        "",
        "hit = cached / prompt tokens (pods' usage); /ceil and the class columns: fraction of "
        "the oracle ceiling;",
        f"TTFT modelled ms, sent after the {max(params['warmup'], after):g} s warm-up; "
        "max/mean = requests "
        "per pod; flight = max/mean of mean in-flight; decision in us;",
        "moved = share of session turns answered by another pod than the turn before",
        "(<= : sidecar histogram bucket bound; radix: exact, in the bench process, no hop;",
        f"radix_x{params['sidecars']}: {params['sidecars']} radix routers, a tree each, requests "
        "spread over them as over the sidecars;",
        "sglang: SGLang's router, a process of its own, its decisions and pods unseen: -)",
        "* the same run as on the gRPC path of the same body (a central router has no gRPC)",
    ]
    lines += _organic_decision_lines(report)
    lines += ["", "targets (as measured in this run)"]
    lines += [
        f"  {t['name']}: {t['measured']} - {'MET' if t['met'] else 'NOT MET'}"
        for t in report["targets"]
    ]
    lines.append(f"\nwall time {report['wall_s']:.0f} s")
    return "\n".join(lines)
