"""One log line and one set of metric updates per streaming call, however it ended.

The line is key=value pairs (status is the gRPC status name, or PARTIAL for a stream that
broke after its first token). Prefix texts and pod words never appear here: only names,
urls, counts, and the caller's validated trace headers.
"""

from __future__ import annotations

import logging
import time

from sidecar.metrics import Metrics
from sidecar.server.relay import RelayOutcome
from sidecar.server.trace_context import TraceContext

logger = logging.getLogger("sidecar.requests")


def record_outcome(
    metrics: Metrics,
    rpc: str,
    prefix: str,
    branch: str,
    outcome: RelayOutcome,
    started: float,
    trace: TraceContext,
) -> None:
    """Count the request, its tokens and cost, and log it. `started` is perf_counter()."""
    status = outcome.status
    metrics.child(metrics.requests, rpc, outcome.backend or "-", branch or "-", status).inc()
    prompt, completion, cached = outcome.usage
    if prompt or completion:
        metrics.record_usage(prefix or "-", prompt, cached, completion)
    ttft = f"{outcome.ttft_s * 1e3:.1f}" if outcome.ttft_s is not None else "-"
    logger.info(
        "%s prefix=%s backend=%s branch=%s attempts=%d status=%s ttft_ms=%s total_ms=%.1f "
        "prompt_tokens=%d cached_tokens=%d completion_tokens=%d traceparent=%s request_id=%s",
        rpc,
        prefix or "-",
        outcome.backend or "-",
        branch or "-",
        outcome.attempts,
        status,
        ttft,
        (time.perf_counter() - started) * 1e3,
        prompt,
        cached,
        completion,
        trace.traceparent or "-",
        trace.request_id or "-",
    )
