"""Series computed when scraped, from routing state the sidecar reads, not pushes: the
prefix tokens each pod is home to, the loads bounded load picks on, organic routing's
decisions and table.

`snapshot` reads the state on the event loop (the routing state is the loop's); `collect`,
possibly in a thread, renders that reading. Every label set here is bounded: member pods,
or a fixed list of kinds and maps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


@dataclass(frozen=True)
class OrganicState:
    decisions: dict[str, int]  # kind -> decisions since start
    table: dict[str, int]  # map -> entries


@dataclass(frozen=True)
class PodLoads:
    loads: dict[str, tuple[int, int | None]]  # url -> (effective load, report or None)
    fleet_scale: float


class ScrapeTimeCollector:
    """A collector that reads its state through `read` at scrape time."""

    def __init__(self, read: Callable[[], object]) -> None:
        self._read = read
        self._snapshot: object = None

    def snapshot(self) -> None:
        self._snapshot = self._read()

    def collect(self) -> Iterator[Metric]:
        snapshot, self._snapshot = self._snapshot, None
        yield from self.families(snapshot if snapshot is not None else self._read())

    def families(self, state: Any) -> Iterator[Metric]:
        raise NotImplementedError


class HomeTokensCollector(ScrapeTimeCollector):
    """The prefix tokens each pod is home to and the budget in use (lazily computed)."""

    def families(self, state: tuple[dict[str, int], int]) -> Iterator[GaugeMetricFamily]:
        homed, budget = state
        tokens = GaugeMetricFamily(
            "prefix_sidecar_home_prefix_tokens",
            "Estimated prefix KV tokens each pod is home to (registered prefixes x replicas)",
            labels=["backend"],
        )
        for url, count in homed.items():
            tokens.add_metric([url], count)
        yield tokens
        yield GaugeMetricFamily(
            "prefix_sidecar_home_kv_budget_tokens",
            "Home KV budget per unit of pod weight in use: home_kv_budget_tokens, else the "
            "pods' reported KV x home_kv_fraction (0: plain ring placement)",
            value=budget,
        )


class PodLoadsCollector(ScrapeTimeCollector):
    """What bounded load picks on, per member pod: the effective load, the pod's own fresh
    report, and the fleet view's K-estimate (docs/load-signals.md)."""

    def families(self, state: PodLoads) -> Iterator[GaugeMetricFamily]:
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
        for url, (load, report) in state.loads.items():
            effective.add_metric([url], load)
            if report is not None:
                reported.add_metric([url], report)
        yield effective
        yield reported
        yield GaugeMetricFamily(
            "prefix_sidecar_fleet_scale",
            "The fleet view's estimate of how many sidecars' requests a pod carries per one "
            "of ours (1 without the fleet view)",
            value=state.fleet_scale,
        )


class OrganicCollector(ScrapeTimeCollector):
    """Organic routing's decisions by kind since start, and its table's entries per map."""

    def families(self, state: OrganicState) -> Iterator[Metric]:
        yield _one_label(
            CounterMetricFamily(
                "prefix_sidecar_organic_decisions",
                "Organic routing decisions of unregistered prompts by kind: unanchored, "
                "later_turn, start_stayed, start_moved, start_far, later_followed "
                "(docs/organic-routing.md)",
                labels=["kind"],
            ),
            state.decisions,
        )
        yield _one_label(
            GaugeMetricFamily(
                "prefix_sidecar_organic_table_entries",
                "Entries the organic anchor table holds per map (blocks, branch_points, "
                "families), both generations; bounded by organic_table_blocks",
                labels=["map"],
            ),
            state.table,
        )


def _one_label(family: CounterMetricFamily | GaugeMetricFamily, values: dict[str, int]) -> Metric:
    """`family` with one sample per (label value, value)."""
    for label, value in values.items():
        family.add_metric([label], value)
    return family
