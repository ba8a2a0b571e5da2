"""The pod's Prometheus metrics, named and labelled like vLLM's (`engine`, `model_name`).

Each emulator gets its own CollectorRegistry so several can share a process (tests).
Gauges are read at scrape time from callables, so they can never go stale. Durations
are observed in MODELLED seconds (real seconds times the time scale).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets for vllm:time_to_first_token_seconds
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
# vLLM's buckets for vllm:e2e_request_latency_seconds
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LOAD_FORMAT_HEADER = "endpoint-load-metrics-format"  # the request asks ...
LOAD_HEADER = "endpoint-load-metrics"  # ... the response answers


class PodMetrics:
    def __init__(
        self,
        model: str,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
        cache_info: dict[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = ["engine", "model_name"]
        series = ("0", model)  # one engine, as a pod without data parallelism has
        self.waiting = waiting
        self.kv_usage = kv_usage
        if cache_info:
            # vLLM's info gauge: the CacheConfig as labels, value 1 (the KV budget reader's
            # source: num_gpu_blocks x block_size).
            info = Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                list(cache_info),
                registry=self.registry,
            )
            info.labels(**cache_info).set(1.0)
        for name, text, read in (
            ("vllm:num_requests_running", "Requests running on the pod.", running),
            ("vllm:num_requests_waiting", "Requests waiting to run.", waiting),
            (
                "vllm:kv_cache_usage_perc",
                "KV cache usage by running requests (1 = full).",
                kv_usage,
            ),
        ):
            gauge = Gauge(name, text, labels, registry=self.registry)
            gauge.labels(*series).set_function(read)

        def model_counter(name: str, text: str) -> Counter:
            """A counter of this pod's model (vLLM labels every series by engine and
            model_name)."""
            return Counter(name, text, labels, registry=self.registry).labels(*series)

        self.prefix_queries = model_counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = model_counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.prompt_tokens = model_counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = model_counter("vllm:generation_tokens", "Tokens generated.")
        self.request_success = Counter(
            "vllm:request_success",
            "Requests finished, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (modelled seconds).",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(*series)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency (modelled seconds).",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(*series)
        self.series = series

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def load_header(self, metrics_format: str) -> dict[str, str]:
        """vLLM's ORCA load report (vllm/entrypoints/openai/orca_metrics.py): the
        `endpoint-load-metrics` response header in the format asked for by the request's
        `endpoint-load-metrics-format` (TEXT or JSON, any case); other formats get none."""
        named = (  # vLLM's order
            ("num_requests_waiting", float(self.waiting())),
            ("kv_cache_usage_perc", float(self.kv_usage())),
        )
        kind = metrics_format.lower()
        if kind == "text":
            text = ", ".join(f"named_metrics.{name}={value}" for name, value in named)
            return {LOAD_HEADER: f"TEXT {text}"}
        if kind == "json":
            return {LOAD_HEADER: "JSON " + json.dumps({"named_metrics": dict(named)})}
        return {}
