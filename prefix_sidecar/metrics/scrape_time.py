"""Series read from each pool's routing state when scraped: homed prefix tokens and budget,
the loads bounded load picks on, organic routing's decisions and table.

`snapshot` reads the state on the event loop (which owns it); `collect`, possibly in a thread,
renders that reading. Label sets are bounded: member pods, pools, fixed kinds and maps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


@dataclass(frozen=True)
class OrganicState:
    decisions: dict[str, int]  # kind -> decisions since start
    table: dict[str, int]  # map -> entries


@dataclass(frozen=True)
class PoolState:
    """One pool's routing state as a scrape reads it."""

    name: str
    homed: dict[str, int]  # url -> prefix tokens the pod is home to
    budget: int  # the home KV budget in use (0: plain ring placement)
    loads: dict[str, tuple[int, int | None]]  # url -> (effective load, report or None)
    fleet_scale: float
    organic: OrganicState | None  # None: the pool routes no prompt organically


class PoolsCollector:
    """Every pool's scrape-time series, read through `read` (lazily computed)."""

    def __init__(self, read: Callable[[], list[PoolState]]) -> None:
        self._read = read
        self._snapshot: list[PoolState] | None = None

    def snapshot(self) -> None:
        self._snapshot = self._read()

    def collect(self) -> Iterator[Metric]:
        pools, self._snapshot = self._snapshot, None
        yield from families(pools if pools is not None else self._read())


def families(pools: list[PoolState]) -> Iterator[Metric]:
    tokens = GaugeMetricFamily(
        "prefix_sidecar_home_prefix_tokens",
        "Estimated prefix KV tokens each pod is home to (registered prefixes x replicas)",
        labels=["backend"],
    )
    budget = GaugeMetricFamily(
        "prefix_sidecar_home_kv_budget_tokens",
        "Home KV budget per unit of pod weight in use, per pool: home_kv_budget_tokens, else "
        "the pods' reported KV x home_kv_fraction (0: plain ring placement)",
        labels=["pool"],
    )
    effective = GaugeMetricFamily(
        "prefix_sidecar_backend_load",
        "The load bounded-load picks see per pod: own in-flight, or the pod's report "
        "when a load rule uses it (docs/load-signals.md)",
        labels=["backend"],
    )
    reported = GaugeMetricFamily(
        "prefix_sidecar_backend_reported_load",
        "The pod's own fresh report in use (running + waiting, or the saturation "
        "report); absent while none is fresh",
        labels=["backend"],
    )
    scale = GaugeMetricFamily(
        "prefix_sidecar_fleet_scale",
        "The fleet view's estimate of how many sidecars' requests a pod carries per one "
        "of ours (1 without the fleet view), per pool",
        labels=["pool"],
    )
    decisions = CounterMetricFamily(
        "prefix_sidecar_organic_decisions",
        "Organic routing decisions of unregistered prompts by pool and kind: unanchored, "
        "later_turn, start_stayed, start_moved, start_far, later_followed "
        "(docs/organic-routing.md)",
        labels=["pool", "kind"],
    )
    table = GaugeMetricFamily(
        "prefix_sidecar_organic_table_entries",
        "Entries the organic anchor table holds per pool and map (blocks, branch_points, "
        "families), both generations; bounded by the table's block cap",
        labels=["pool", "map"],
    )
    organic = False
    for pool in pools:
        for url, count in pool.homed.items():
            tokens.add_metric([url], count)
        budget.add_metric([pool.name], pool.budget)
        for url, (load, report) in pool.loads.items():
            effective.add_metric([url], load)
            if report is not None:
                reported.add_metric([url], report)
        scale.add_metric([pool.name], pool.fleet_scale)
        if pool.organic is not None:
            organic = True
            for kind, count in pool.organic.decisions.items():
                decisions.add_metric([pool.name, kind], count)
            for name, count in pool.organic.table.items():
                table.add_metric([pool.name, name], count)
    yield from (tokens, budget, effective, reported, scale)
    if organic:
        yield from (decisions, table)
