"""One log line and one set of metric updates per streaming call, however it ended.

The line is key=value pairs, or JSON keys with `log_format: json` (status is the gRPC
status name, or PARTIAL for a stream that broke after its first token). Prefix texts and
pod words never appear here: only names, urls, counts, and the caller's validated trace
headers.
"""

from __future__ import annotations

import logging
import time

from prefix_sidecar.logs import log_fields
from prefix_sidecar.metrics import Metrics
from prefix_sidecar.server.common.trace_context import TraceContext
from prefix_sidecar.upstream.outcome import RelayOutcome

logger = logging.getLogger("sidecar.requests")


def record_outcome(
    metrics: Metrics,
    rpc: str,
    prefix: str,
    branch: str,
    outcome: RelayOutcome,
    started: float,
    trace: TraceContext,
    *,
    front: str,
    decision_ns: int | None = None,
) -> None:
    """Count the request, its tokens and cost, and log it. `started` is perf_counter();
    `front` is the listener that took it (FRONT_GRPC or FRONT_HTTP, the metrics' label);
    `decision_ns` the time to choose its pod (precise routing's waits for a /tokenize), so
    a slow first token says whether the pod or the choice was slow."""
    status = outcome.status
    backend = outcome.backend or "-"
    pool = outcome.pool or "-"
    metrics.child(metrics.requests, front, rpc, pool, backend, branch or "-", status).inc()
    prompt, completion, cached = outcome.usage
    if prompt or completion:
        metrics.record_usage(prefix or "-", prompt, cached, completion)
    log_fields(
        logger,
        logging.INFO,
        rpc,
        {
            "prefix": prefix or None,
            "backend": outcome.backend or None,
            "pool": outcome.pool or None,
            "branch": branch or None,
            "attempts": outcome.attempts,
            "status": status,
            "decision_ms": None if decision_ns is None else decision_ns / 1e6,
            "ttft_ms": None if outcome.ttft_s is None else outcome.ttft_s * 1e3,
            "total_ms": (time.perf_counter() - started) * 1e3,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": completion,
            "traceparent": trace.traceparent or None,
            "request_id": trace.request_id or None,
        },
    )
