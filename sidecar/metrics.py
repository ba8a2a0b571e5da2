"""Prometheus metrics of one sidecar, on their own registry (several sidecars may share a
process in tests), served as text on the metrics port.

The cost counters apply the note's price model to the pods' real `cached_tokens`, so the
daily saving the design note promises can be watched live, not only computed offline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

DECISION_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 5e-4, 1e-3, 1e-2)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 60.0)

M = TypeVar("M", bound=MetricWrapperBase)


class Metrics:
    def __init__(self, price_base: float = 2.0, price_cache: float = 0.2, price_out: float = 6.0):
        self.registry = CollectorRegistry()
        self._prices = (price_base / 1e6, price_cache / 1e6, price_out / 1e6)
        r = self.registry
        self.requests = Counter(
            "prefix_sidecar_requests",
            "Requests by RPC, backend, routing branch and status",
            ["rpc", "backend", "branch", "status"],
            registry=r,
        )
        self.failovers = Counter(
            "prefix_sidecar_failovers",
            "Attempts moved to the next pod before the first token",
            ["backend", "reason"],
            registry=r,
        )
        self.decision = Histogram(
            "prefix_sidecar_decision_seconds",
            "Time to choose a pod",
            ["rpc"],
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "prefix_sidecar_ttft_seconds",
            "Time to first token through the sidecar",
            ["backend"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "prefix_sidecar_in_flight",
            "In-flight upstream requests per backend",
            ["backend"],
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
            "What the served tokens would cost with no prefix cache (note's prices)",
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

    def child(self, metric: M, *labels: str) -> M:
        """`metric.labels(*labels)`, memoised: labels() takes a lock and rebuilds the key on
        every call, and the request path asks for the same few series each time. A series
        dropped with remove() must be forgotten here too (forget_backend does)."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found  # type: ignore[return-value]  # the child of an M is an M

    def record_usage(self, prefix: str, prompt: int, cached: int, completion: int) -> None:
        base, cache, out = self._prices
        cached = min(cached, prompt)
        self.prompt_tokens.labels(prefix).inc(prompt)
        self.cached_tokens.labels(prefix).inc(cached)
        self.completion_tokens.labels(prefix).inc(completion)
        raw = prompt * base + completion * out
        actual = (prompt - cached) * base + cached * cache + completion * out
        self.cost_raw.inc(raw)
        self.cost_actual.inc(actual)
        self._raw_total += raw
        self._actual_total += actual
        if self._raw_total > 0:
            self.saving_ratio.set(1.0 - self._actual_total / self._raw_total)

    def set_backend(self, url: str, state: str, healthy: bool | None) -> None:
        self.backend_healthy.labels(url).set(1.0 if healthy else 0.0)
        for name in ("warming", "serving", "ejected"):
            self.backend_state.labels(url, name).set(1.0 if name == state else 0.0)

    def forget_backend(self, url: str) -> None:
        for metric in (self.backend_healthy, self.in_flight):
            self._children.pop((metric, (url,)), None)
            with contextlib.suppress(KeyError):
                metric.remove(url)
        for name in ("warming", "serving", "ejected"):
            with contextlib.suppress(KeyError):
                self.backend_state.remove(url, name)

    def watch_home_tokens(self, homed: Callable[[], dict[str, int]], budget: int) -> None:
        """Export, at scrape time, the prefix tokens each pod is home to and the budget
        (routing contract section 6): a pod near its budget is where KV will run short."""
        self.registry.register(_HomeTokens(homed, budget))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _HomeTokens:
    """A scrape-time collector: the placement is computed lazily, so it is read, not pushed."""

    def __init__(self, homed: Callable[[], dict[str, int]], budget: int) -> None:
        self._homed = homed
        self._budget = budget

    def collect(self) -> Iterator[GaugeMetricFamily]:
        tokens = GaugeMetricFamily(
            "prefix_sidecar_home_prefix_tokens",
            "Estimated prefix KV tokens each pod is home to (registered prefixes x replicas)",
            labels=["backend"],
        )
        for url, count in self._homed().items():
            tokens.add_metric([url], count)
        yield tokens
        yield GaugeMetricFamily(
            "prefix_sidecar_home_kv_budget_tokens",
            "Configured home_kv_budget_tokens per unit of pod weight (0: plain ring placement)",
            value=self._budget,
        )


async def start_metrics_server(metrics: Metrics, host: str, port: int) -> web.AppRunner:
    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
