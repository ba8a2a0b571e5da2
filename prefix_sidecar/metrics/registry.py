"""One sidecar's metrics on their own registry (tests run several per process): the request
path's memoised series, the cost model, and the sweep that keeps label sets bounded.

The cost counters apply docs/mission.md's prices to the pods' real `cached_tokens`, so the
saving is watched live. Pod IPs churn and prefix names come and go, so series of departed
pods and unregistered names are dropped (`forget_*`, and before every scrape, which also
catches a series that a stream running at the change recreated when it ended).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase

from prefix_sidecar.config import DEFAULTS
from prefix_sidecar.metrics.scrape_time import PoolsCollector, PoolState
from prefix_sidecar.metrics.series import (
    BACKEND_HEALTHY,
    BACKEND_STATE,
    CACHED_TOKENS,
    COMPLETION_TOKENS,
    COST,
    COST_WITHOUT_CACHE,
    DECISION,
    FAILOVERS,
    IN_FLIGHT,
    KV_EVENT_LAG,
    KV_EVENTS,
    KV_INDEX_QUERIES,
    NONE_LABEL,
    PRECISE_DECISIONS,
    PREWARM,
    PROMPT_TOKENS,
    REPREWARMS,
    REQUESTS,
    RESIDENT_PREFIXES,
    SAVING_RATIO,
    TTFT,
    UNASKED_ANSWERS,
    M,
    Series,
)


class PoolView(Protocol):
    """What a scrape reads of a pool (server/model_pool.py ModelPool)."""

    def scrape_state(self) -> PoolState: ...


# (metric, the position of the label that names a pod or a prefix)
Bounded = list[tuple[MetricWrapperBase, int]]


def _always(_: str) -> bool:
    return True


class Metrics:
    def __init__(self, prices: tuple[float, float, float] = DEFAULTS.prices) -> None:
        """`prices`: docs/mission.md's price model, in yuan per million tokens: a prompt token
        computed, a prompt token read from the prefix cache, an output token."""
        self.registry = CollectorRegistry()
        # The standard process_* (memory, fds, CPU), python_info and python_gc_* series,
        # which prometheus_client only puts on its default registry.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._prices = tuple(price / 1e6 for price in prices)
        self._per_backend: Bounded = []
        self._per_prefix: Bounded = []
        self.requests = self._register(REQUESTS)
        self.failovers = self._register(FAILOVERS)
        self.unasked_bytes = self._register(UNASKED_ANSWERS)
        self.decision = self._register(DECISION)
        self.ttft = self._register(TTFT)
        self.in_flight = self._register(IN_FLIGHT)
        self.prompt_tokens = self._register(PROMPT_TOKENS)
        self.cached_tokens = self._register(CACHED_TOKENS)
        self.completion_tokens = self._register(COMPLETION_TOKENS)
        self.backend_healthy = self._register(BACKEND_HEALTHY)
        self.backend_state = self._register(BACKEND_STATE)
        self.prewarm = self._register(PREWARM)
        self.kv_events = self._register(KV_EVENTS)
        self.kv_event_lag = self._register(KV_EVENT_LAG)
        self.reprewarms = self._register(REPREWARMS)
        self.resident_prefixes = self._register(RESIDENT_PREFIXES)
        self.precise_decisions = self._register(PRECISE_DECISIONS)
        self.kv_index_queries = self._register(KV_INDEX_QUERIES)
        self.cost_raw = self._register(COST_WITHOUT_CACHE)
        self.cost_actual = self._register(COST)
        self.saving_ratio = self._register(SAVING_RATIO)
        self._raw_total = 0.0
        self._actual_total = 0.0
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}
        self._live_backend: Callable[[str], bool] = _always
        self._live_prefix: Callable[[str], bool] = _always
        self._pools: PoolsCollector | None = None

    def _register(self, spec: Series[M]) -> M:
        """Build `spec` on this registry; a series with a pod or prefix label is swept."""
        metric = spec.register(self.registry)
        if "backend" in spec.labels:
            self._per_backend.append((metric, spec.labels.index("backend")))
        elif "prefix" in spec.labels:
            self._per_prefix.append((metric, spec.labels.index("prefix")))
        return metric

    def child(self, metric: M, *labels: str) -> M:
        """`metric.labels(*labels)`, memoised: labels() takes a lock and rebuilds the key on
        every call, and the request path asks for the same few series each time. A series
        dropped with remove() must be forgotten here too (_drop does)."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found  # type: ignore[return-value]  # the child of an M is an M

    def remove(self, metric: MetricWrapperBase, *labels: str) -> None:
        """Drop one series (and its memoised child), if it is there."""
        self._children.pop((metric, labels), None)
        with contextlib.suppress(KeyError):
            metric.remove(*labels)

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

    # --- bounded label sets -------------------------------------------------------------

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
        for metric, _ in self._per_prefix:
            self.remove(metric, name)

    def _drop(self, metrics: Bounded, live: Callable[[str], bool]) -> None:
        for metric, position in metrics:
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
                self.remove(metric, *labels)

    # --- scrape-time series and rendering -----------------------------------------------

    def watch_pools(self, pools: Sequence[PoolView]) -> None:
        """Export each pool's routing state at scrape time (scrape_time.py): homed tokens and
        budget (routing contract section 6), loads, and organic routing's decisions and table
        (docs/organic-routing.md, "Observing it")."""
        self._pools = PoolsCollector(lambda: [pool.scrape_state() for pool in pools])
        self.registry.register(self._pools)

    def render(self) -> bytes:
        self._prepare_scrape()
        return generate_latest(self.registry)

    async def render_off_loop(self) -> bytes:
        """`render` for the endpoint, built in a thread (~100 ms at 100 pods x 1,024 names) so
        the loop gets the GIL every 5 ms switch interval. What reads routing state (the sweep,
        the scrape-time snapshot) stays on the loop."""
        self._prepare_scrape()
        return await asyncio.to_thread(generate_latest, self.registry)

    def _prepare_scrape(self) -> None:
        self.forget_backends()
        self.forget_prefixes()
        if self._pools is not None:
            self._pools.snapshot()


def _label_sets(metric: MetricWrapperBase) -> list[tuple[str, ...]]:
    """The label values of every series of a labelled metric, from prometheus_client's private
    children map: collect() builds every sample, ~30x slower (100 pods x 1,024 names)."""
    with metric._lock:
        return [tuple(labels) for labels in metric._metrics]
