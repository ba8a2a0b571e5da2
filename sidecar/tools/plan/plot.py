"""`--plot FILE`: the sidecar column's GPUs and TTFT p99 against the hit rate (one PNG)."""

from __future__ import annotations

import dataclasses

from sidecar.tools.plan import capacity
from sidecar.tools.plan.scenario import Scenario, ScenarioError

HIT_RATES = (0.0, 0.5, 0.7, 0.8, 0.9, 0.95, 0.964, 0.98, 0.99, 1.0)


def sweep(scenario: Scenario, samples: int) -> list[tuple[float, float, float]]:
    """(hit rate, GPUs, TTFT p99 ms at peak) at every hit rate the SLO can be met at."""
    points = []
    for rate in HIT_RATES:
        prefixes = tuple(dataclasses.replace(p, hit_rate=None) for p in scenario.traffic.prefixes)
        at = dataclasses.replace(
            scenario,
            traffic=dataclasses.replace(scenario.traffic, prefixes=prefixes),
            routing=dataclasses.replace(scenario.routing, hit_rate=rate),
        )
        try:
            column = capacity.plan_column(at, capacity.SIDECAR, samples=samples)
        except ScenarioError:
            continue  # the SLO cannot be met at this hit rate: no point
        points.append((rate, float(column.gpus), column.p99_ms))
    return points


def plot(scenario: Scenario, path: str, *, samples: int = 20_000) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sweep(scenario, samples)
    figure, gpus_axis = plt.subplots(figsize=(8, 5), dpi=110)
    rates = [100 * p[0] for p in points]
    gpus_axis.plot(rates, [p[1] for p in points], "o-", color="tab:blue", label="GPUs")
    gpus_axis.set_xlabel("prefix-token hit rate, %")
    gpus_axis.set_ylabel("GPUs needed at the SLO", color="tab:blue")
    gpus_axis.set_yscale("log")
    ttft_axis = gpus_axis.twinx()
    ttft_axis.plot(rates, [p[2] for p in points], "s--", color="tab:red", label="TTFT p99")
    ttft_axis.set_ylabel("TTFT p99 at peak, ms", color="tab:red")
    ttft_axis.axhline(scenario.traffic.slo_ms, color="grey", linestyle=":", linewidth=1)
    t = scenario.traffic
    gpus_axis.set_title(
        f"plan ({scenario.name}): {t.peak_rps:,.0f} req/s, SLO p99 {t.slo_ms:,.0f} ms "
        f"({scenario.routing.miss} misses); hit rates the SLO cannot take are left out"
    )
    gpus_axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
