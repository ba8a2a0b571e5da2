"""`--plot FILE`: GPUs needed and TTFT p99 against the hit rate (the sidecar column, one PNG).

Where no fleet meets the SLO at a hit rate (every request's uncached part alone takes
longer), the point is sized as the no-cache column is, to the scenario's slack (SLO / the
sidecar column's idle p99) x that hit rate's idle p99, and drawn hollow: the curve runs
from no cache (hit rate 0) to a perfect cache.
"""

from __future__ import annotations

import dataclasses

from prefix_sidecar_tools.plan import capacity
from prefix_sidecar_tools.plan.scenario import Scenario

HIT_RATES = (0.0, 0.25, 0.5, 0.7, 0.8, 0.9, 0.95, 0.964, 0.98, 0.99, 1.0)
MIN_SLACK = 1.25  # when the scenario's own SLO gives less (or none)


def sweep(scenario: Scenario, samples: int) -> list[tuple[float, float, float, bool]]:
    """(hit rate, GPUs, TTFT p99 ms at peak, whether the SLO itself was met)."""
    points = []
    slack = max(
        MIN_SLACK, scenario.traffic.slo_ms / capacity.idle_p99_ms(scenario, capacity.SIDECAR)
    )
    prefixes = tuple(dataclasses.replace(p, hit_rate=None) for p in scenario.traffic.prefixes)
    for rate in HIT_RATES:
        at = dataclasses.replace(
            scenario,
            traffic=dataclasses.replace(scenario.traffic, prefixes=prefixes),
            routing=dataclasses.replace(scenario.routing, hit_rate=rate),
        )
        met = True
        try:
            column = capacity.plan_column(at, capacity.SIDECAR, samples=samples)
        except capacity.Unreachable:
            met = False
            slo = slack * capacity.idle_p99_ms(at, capacity.SIDECAR)
            at = dataclasses.replace(at, traffic=dataclasses.replace(at.traffic, slo_ms=slo))
            column = capacity.plan_column(at, capacity.SIDECAR, samples=samples)
        points.append((rate, float(column.gpus), column.p99_ms, met))
    return points


def plot(scenario: Scenario, path: str, *, samples: int = 20_000) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    points = sweep(scenario, samples)
    figure, gpus_axis = plt.subplots(figsize=(9, 5.5), dpi=110)
    rates = [100 * p[0] for p in points]
    ttft_axis = gpus_axis.twinx()
    gpus_axis.plot(rates, [p[1] for p in points], "-", color="tab:blue", linewidth=1.5)
    ttft_axis.plot(rates, [p[2] for p in points], "--", color="tab:red", linewidth=1.5)
    for rate, gpus, p99, met in points:
        face = "tab:blue" if met else "white"
        gpus_axis.plot(100 * rate, gpus, "o", color="tab:blue", markerfacecolor=face)
        ttft_axis.plot(
            100 * rate, p99, "s", color="tab:red", markerfacecolor=face if met else "white"
        )
    gpus_axis.set_xlabel("prefix-token hit rate, %")
    gpus_axis.set_ylabel("GPUs needed (log scale)", color="tab:blue")
    gpus_axis.set_yscale("log")
    gpus_axis.yaxis.set_major_formatter(ScalarFormatter())
    ttft_axis.set_ylabel("TTFT p99 at peak, ms (log scale)", color="tab:red")
    ttft_axis.set_yscale("log")
    ttft_axis.yaxis.set_major_formatter(ScalarFormatter())
    t = scenario.traffic
    ttft_axis.axhline(t.slo_ms, color="grey", linestyle=":", linewidth=1)
    gpus_axis.set_title(
        f"plan ({scenario.name}): {t.peak_rps:,.0f} req/s, TTFT p99 SLO {t.slo_ms:,.0f} ms "
        f"(dotted), {scenario.routing.miss} misses\nhollow: no fleet meets the SLO at that "
        f"hit rate; sized with the SLO's slack over an idle pod's p99 instead"
    )
    gpus_axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
