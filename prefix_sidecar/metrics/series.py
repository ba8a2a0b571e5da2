"""Every series a sidecar exports, said once: kind, name, help, label names and buckets.

A label named `backend` or `prefix` names a pod or a prefix, and those come and go: the
registry sweeps such series when their pod or name is gone (registry.py), so the label
names here decide what is bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)

# Up to 1 ms: a decision on the sidecar's own state. Above: precise routing's, which waits
# for a pod's /tokenize (1.7-39 ms on real vLLM) and, with kv_index_url, Redis.
DECISION_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 60.0)

# A label value that never names a pod or a prefix ("no backend", "no prefix"): always kept.
NONE_LABEL = "-"

# The `front` label: which listener took the request (gRPC, or the OpenAI HTTP front).
FRONT_GRPC = "grpc"
FRONT_HTTP = "http"


@dataclass(frozen=True)
class Series(Generic[M]):
    """One metric family as prometheus_client builds it."""

    kind: Callable[..., M]
    name: str
    documentation: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    def register(self, registry: CollectorRegistry) -> M:
        if self.buckets is None:
            return self.kind(self.name, self.documentation, self.labels, registry=registry)
        return self.kind(
            self.name, self.documentation, self.labels, registry=registry, buckets=self.buckets
        )


REQUESTS = Series(
    Counter,
    "prefix_sidecar_requests",
    "Requests by front end (grpc or http), RPC, pool, backend, routing branch and status",
    ("front", "rpc", "pool", "backend", "branch", "status"),
)
FAILOVERS = Series(
    Counter,
    "prefix_sidecar_failovers",
    "Attempts moved to the next pod before the first token, by front end (grpc or "
    "http), backend and reason",
    ("front", "backend", "reason"),
)
UNASKED_ANSWERS = Series(
    Counter,
    "prefix_sidecar_pod_unasked_answers",
    "Pod connections closed because the pod sent bytes past the answer asked for "
    "(a second answer, a 204's body): never read as another caller's answer",
    ("backend",),
)
DECISION = Series(
    Histogram,
    "prefix_sidecar_decision_seconds",
    "Time to choose a pod, by front end (grpc or http) and RPC",
    ("front", "rpc"),
    buckets=DECISION_BUCKETS,
)
TTFT = Series(
    Histogram,
    "prefix_sidecar_ttft_seconds",
    "Time to first token through the sidecar, by front end (grpc or http) and backend",
    ("front", "backend"),
    buckets=TTFT_BUCKETS,
)
IN_FLIGHT = Series(
    Gauge,
    "prefix_sidecar_in_flight",
    "In-flight upstream requests by front end (grpc or http) and backend",
    ("front", "backend"),
)
PROMPT_TOKENS = Series(
    Counter, "prefix_sidecar_prompt_tokens", "Prompt tokens reported by the pods", ("prefix",)
)
CACHED_TOKENS = Series(
    Counter,
    "prefix_sidecar_cached_tokens",
    "Prompt tokens the pods served from prefix cache",
    ("prefix",),
)
COMPLETION_TOKENS = Series(
    Counter, "prefix_sidecar_completion_tokens", "Completion tokens", ("prefix",)
)
BACKEND_HEALTHY = Series(
    Gauge, "prefix_sidecar_backend_healthy", "1 when the backend passes health checks", ("backend",)
)
BACKEND_STATE = Series(
    Gauge, "prefix_sidecar_backend_state", "1 for the backend's current state", ("backend", "state")
)
PREWARM = Series(
    Counter, "prefix_sidecar_prewarm", "Prewarm attempts by result", ("backend", "result")
)
KV_EVENTS = Series(
    Counter,
    "prefix_sidecar_kv_events",
    "A pod's KV-event batches by outcome: batch, replayed, start, restart, and the losses "
    "gap, decode_error, disconnected, no_source (prefix_sidecar/kv_events/subscriber.py)",
    ("backend", "outcome"),
)
KV_EVENT_LAG = Series(
    Gauge,
    "prefix_sidecar_kv_event_lag_seconds",
    "Seconds from a pod's latest KV-event batch (its timestamp) to its arrival here",
    ("backend",),
)
REPREWARMS = Series(
    Counter,
    "prefix_sidecar_reprewarms",
    "Prewarms of a registered prefix on a home pod that lost it, by reason: evicted, cleared, "
    "restarted, unknown; not sent: throttled (one per prefix and pod per "
    "reprewarm_interval_s), no_room (it does not fit beside the registered prefixes the "
    "pod holds) and busy (held back while the pod is over its share of requests)",
    ("reason",),
)
RESIDENT_PREFIXES = Series(
    Gauge,
    "prefix_sidecar_resident_prefixes",
    "Registered prefixes a home pod holds every whole block of, by its KV events (absent "
    "while the pod's state is unknown)",
    ("backend",),
)
PRECISE_DECISIONS = Series(
    Counter,
    "prefix_sidecar_precise_decisions",
    "Unregistered requests under precise routing, by outcome: moved (to the pod holding "
    "more of the prompt), kept (the organic pick holds the most, or the better pods are "
    "full), placed (no pod holds a block of it: sent to the pod sent the least new content "
    "lately), cold (no pod holds a block of it, and the organic pick stands), quickest (to "
    "the pod whose first token would come first, its prefill queue counted, discarding "
    "cached tokens only within its budget), "
    "tokenize_error and no_answer (the pod's /tokenize or the index failed: the organic "
    "pick stands)",
    ("outcome",),
)
KV_INDEX_QUERIES = Series(
    Counter,
    "prefix_sidecar_kv_index_queries",
    "Lookups of the shared block index (kv_index_url) by outcome: hit (a pod holds the "
    "prompt's first block), miss, timeout (over its deadline), down (Redis unreachable)",
    ("outcome",),
)
COST_WITHOUT_CACHE = Series(
    Counter,
    "prefix_sidecar_cost_without_cache_yuan",
    "What the served tokens would cost with no prefix cache (docs/mission.md's prices)",
)
COST = Series(
    Counter,
    "prefix_sidecar_cost_yuan",
    "What the served tokens cost with the measured cache hits",
)
SAVING_RATIO = Series(
    Gauge, "prefix_sidecar_cost_saving_ratio", "1 - cost / cost_without_cache, since start"
)
