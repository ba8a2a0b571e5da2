"""Prometheus metrics of one sidecar, on their own registry (several sidecars may share a
process in tests), served as text on the metrics port.

The cost counters apply docs/mission.md's price model to the pods' real `cached_tokens`, so the
daily saving the design note promises can be watched live, not only computed offline.

Label sets stay bounded: pod IPs change on every rollout and prefix names come and go, so the
series of a pod that left the membership, or of a name no longer registered, are dropped
(`forget_backends`, `forget_prefixes`, and again before every scrape, which also catches a
series that a stream still running at the change recreated when it ended).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

from prefix_sidecar.config import DEFAULTS

DECISION_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 5e-4, 1e-3, 1e-2)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 60.0)

M = TypeVar("M", bound=MetricWrapperBase)

# A label value that never names a pod or a prefix ("no backend", "no prefix"): always kept.
NONE_LABEL = "-"

# The `front` label of the per-request series: which listener took the request (the gRPC
# service, or the OpenAI-compatible HTTP front). Two values, so the label sets stay bounded.
FRONT_GRPC = "grpc"
FRONT_HTTP = "http"


def _always(_: str) -> bool:
    return True


class Metrics:
    def __init__(
        self,
        price_base: float = DEFAULTS.price_base,
        price_cache: float = DEFAULTS.price_cache,
        price_out: float = DEFAULTS.price_out,
    ) -> None:
        self.registry = CollectorRegistry()
        # The standard process_* (memory, fds, CPU), python_info and python_gc_* series,
        # which prometheus_client only puts on its default registry.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._prices = (price_base / 1e6, price_cache / 1e6, price_out / 1e6)
        r = self.registry
        self.requests = Counter(
            "prefix_sidecar_requests",
            "Requests by front end (grpc or http), RPC, backend, routing branch and status",
            ["front", "rpc", "backend", "branch", "status"],
            registry=r,
        )
        self.failovers = Counter(
            "prefix_sidecar_failovers",
            "Attempts moved to the next pod before the first token, by front end (grpc or "
            "http), backend and reason",
            ["front", "backend", "reason"],
            registry=r,
        )
        self.unasked_bytes = Counter(
            "prefix_sidecar_pod_unasked_answers",
            "Pod connections closed because the pod sent bytes past the answer asked for "
            "(a second answer, a 204's body): never read as another caller's answer",
            ["backend"],
            registry=r,
        )
        self.decision = Histogram(
            "prefix_sidecar_decision_seconds",
            "Time to choose a pod, by front end (grpc or http) and RPC",
            ["front", "rpc"],
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "prefix_sidecar_ttft_seconds",
            "Time to first token through the sidecar, by front end (grpc or http) and backend",
            ["front", "backend"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "prefix_sidecar_in_flight",
            "In-flight upstream requests by front end (grpc or http) and backend",
            ["front", "backend"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "prefix_sidecar_prompt_tokens",
            "Prompt tokens reported by the pods",
            ["prefix"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "prefix_sidecar_cached_tokens",
            "Prompt tokens the pods served from prefix cache",
            ["prefix"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "prefix_sidecar_completion_tokens",
            "Completion tokens",
            ["prefix"],
            registry=r,
        )
        self.backend_healthy = Gauge(
            "prefix_sidecar_backend_healthy",
            "1 when the backend passes health checks",
            ["backend"],
            registry=r,
        )
        self.backend_state = Gauge(
            "prefix_sidecar_backend_state",
            "1 for the backend's current state",
            ["backend", "state"],
            registry=r,
        )
        self.prewarm = Counter(
            "prefix_sidecar_prewarm",
            "Prewarm attempts by result",
            ["backend", "result"],
            registry=r,
        )
        self.cost_raw = Counter(
            "prefix_sidecar_cost_without_cache_yuan",
            "What the served tokens would cost with no prefix cache (docs/mission.md's prices)",
            registry=r,
        )
        self.cost_actual = Counter(
            "prefix_sidecar_cost_yuan",
            "What the served tokens cost with the measured cache hits",
            registry=r,
        )
        self.saving_ratio = Gauge(
            "prefix_sidecar_cost_saving_ratio",
            "1 - cost / cost_without_cache, since start",
            registry=r,
        )
        self._raw_total = 0.0
        self._actual_total = 0.0
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}
        # (metric, its label names, the position of the label that names a pod or a prefix)
        self._per_backend = [
            (m, names, names.index("backend"))
            for m, names in (
                (self.requests, ("front", "rpc", "backend", "branch", "status")),
                (self.failovers, ("front", "backend", "reason")),
                (self.unasked_bytes, ("backend",)),
                (self.ttft, ("front", "backend")),
                (self.in_flight, ("front", "backend")),
                (self.backend_healthy, ("backend",)),
                (self.backend_state, ("backend", "state")),
                (self.prewarm, ("backend", "result")),
            )
        ]
        self._per_prefix = [
            (m, ("prefix",), 0)
            for m in (self.prompt_tokens, self.cached_tokens, self.completion_tokens)
        ]
        self._live_backend: Callable[[str], bool] = _always
        self._live_prefix: Callable[[str], bool] = _always
        self._home_tokens: _HomeTokens | None = None
        self._pod_loads: _PodLoads | None = None
        self._organic: _Organic | None = None

    def child(self, metric: M, *labels: str) -> M:
        """`metric.labels(*labels)`, memoised: labels() takes a lock and rebuilds the key on
        every call, and the request path asks for the same few series each time. A series
        dropped with remove() must be forgotten here too (_drop does)."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found  # type: ignore[return-value]  # the child of an M is an M

    def record_usage(self, prefix: str, prompt: int, cached: int, completion: int) -> None:
        base, cache, out = self._prices
        cached = min(cached, prompt)
        self.child(self.prompt_tokens, prefix).inc(prompt)
        self.child(self.cached_tokens, prefix).inc(cached)
        self.child(self.completion_tokens, prefix).inc(completion)
        raw = prompt * base + completion * out
        actual = (prompt - cached) * base + cached * cache + completion * out
        self.cost_raw.inc(raw)
        self.cost_actual.inc(actual)
        self._raw_total += raw
        self._actual_total += actual
        if self._raw_total > 0:
            self.saving_ratio.set(1.0 - self._actual_total / self._raw_total)

    def set_backend(self, url: str, state: str, healthy: bool | None) -> None:
        self.child(self.backend_healthy, url).set(1.0 if healthy else 0.0)
        for name in ("warming", "serving", "ejected"):
            self.child(self.backend_state, url, name).set(1.0 if name == state else 0.0)

    def track(
        self, live_backend: Callable[[str], bool], live_prefix: Callable[[str], bool]
    ) -> None:
        """Tell the metrics which pods and prefix names are current; every scrape first drops
        the series of the others."""
        self._live_backend = live_backend
        self._live_prefix = live_prefix

    def forget_backends(self) -> None:
        """Drop the series of every pod that is not a member any more (`track`)."""
        self._drop(self._per_backend, self._live_backend)

    def forget_prefixes(self) -> None:
        """Drop the token series of every prefix name that is not registered any more."""
        self._drop(self._per_prefix, self._live_prefix)

    def forget_prefix(self, name: str) -> None:
        """Drop one name's token series (it was unregistered): O(1), unlike a sweep."""
        for metric, _, _ in self._per_prefix:
            self._children.pop((metric, (name,)), None)
            with contextlib.suppress(KeyError):
                metric.remove(name)

    def _drop(
        self,
        metrics: Iterable[tuple[MetricWrapperBase, tuple[str, ...], int]],
        live: Callable[[str], bool],
    ) -> None:
        for metric, _, position in metrics:
            doomed = [
                labels
                for labels in _label_sets(metric)
                if labels[position] != NONE_LABEL and not live(labels[position])
            ]
            if doomed and metric is self.in_flight:
                # A stream still running on a pod that left ends with in_flight.dec(): its
                # series stays until that count is back to 0, or it would come back at -1
                # (a sweep after the stream ends removes it).
                running = {
                    (sample.labels["front"], sample.labels["backend"])
                    for family in metric.collect()
                    for sample in family.samples
                    if sample.value != 0
                }
                doomed = [labels for labels in doomed if labels not in running]
            for labels in doomed:
                self._children.pop((metric, labels), None)
                with contextlib.suppress(KeyError):
                    metric.remove(*labels)

    def watch_home_tokens(
        self, homed: Callable[[], dict[str, int]], budget: Callable[[], int]
    ) -> None:
        """Export, at scrape time, the prefix tokens each pod is home to and the budget in
        use (routing contract section 6; configured, or from the pods' KV): a pod near its
        budget is where KV will run short."""
        self._home_tokens = _HomeTokens(lambda: (homed(), budget()))
        self.registry.register(self._home_tokens)

    def watch_pod_loads(self, read: Callable[[], PodLoads]) -> None:
        """Export, at scrape time, the loads bounded load picks on (bounded: member pods)."""
        self._pod_loads = _PodLoads(read)
        self.registry.register(self._pod_loads)

    def watch_organic(self, read: Callable[[], OrganicState]) -> None:
        """Export, at scrape time, what organic routing decided and how much it has learnt
        (docs/organic-routing.md, "Observing it"): fixed label sets, bounded."""
        self._organic = _Organic(read)
        self.registry.register(self._organic)

    def render(self) -> bytes:
        self._prepare_scrape()
        return generate_latest(self.registry)

    async def render_off_loop(self) -> bytes:
        """`render` for the metrics endpoint: the text is built in a thread. At 100 pods and
        1,024 names it is ~12k lines and ~100 ms of Python; in a thread the event loop still
        gets the GIL every switch interval (5 ms) instead of waiting for the whole scrape.
        What reads routing state (the sweep, the homed tokens) stays on the loop."""
        self._prepare_scrape()
        return await asyncio.to_thread(generate_latest, self.registry)

    def _prepare_scrape(self) -> None:
        self.forget_backends()
        self.forget_prefixes()
        for collector in (self._home_tokens, self._pod_loads, self._organic):
            if collector is not None:
                collector.snapshot()


def _label_sets(metric: MetricWrapperBase) -> list[tuple[str, ...]]:
    """The label values of every series of a labelled metric. prometheus_client has no public
    list of a metric's children, and collect() builds every sample (16 per histogram child):
    that made a sweep ~30 ms at 100 pods and 1,024 names, this ~1 ms."""
    with metric._lock:
        return [tuple(labels) for labels in metric._metrics]


class _ScrapeTime:
    """A scrape-time collector: routing state is read, not pushed. `snapshot` reads it on
    the event loop; `collect` (possibly in a thread) renders that reading."""

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


class _HomeTokens(_ScrapeTime):
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


class _PodLoads(_ScrapeTime):
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


class _Organic(_ScrapeTime):
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


@dataclass(frozen=True)
class OrganicState:
    decisions: dict[str, int]  # kind -> decisions since start
    table: dict[str, int]  # map -> entries


@dataclass(frozen=True)
class PodLoads:
    loads: dict[str, tuple[int, int | None]]  # url -> (effective load, report or None)
    fleet_scale: float


async def start_metrics_server(
    metrics: Metrics, host: str, port: int, routes: Iterable[web.RouteDef] = ()
) -> web.AppRunner:
    """Serve /metrics, plus `routes` (the probes) on the same port."""

    async def handle(_: web.Request) -> web.Response:
        body = await metrics.render_off_loop()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
