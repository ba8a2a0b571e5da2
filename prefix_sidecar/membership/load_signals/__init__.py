"""What the pods say about their own load and KV, turned into the load bounded-load picks on
(docs/load-signals.md): `parse` reads the header and the /metrics page, `rules` says what a
reading means for a pod's load, `poller` asks the pods the traffic has not heard from."""

from prefix_sidecar.membership.load_signals.parse import (
    FORMAT_HEADER,
    LOAD_HEADER,
    MAX_HEADER_CHARS,
    PodReport,
    parse_load_header,
    parse_metrics,
)
from prefix_sidecar.membership.load_signals.poller import MetricsError, MetricsPoller, fetch_metrics
from prefix_sidecar.membership.load_signals.rules import LoadRule, LoadSignals, PodState

__all__ = [
    "FORMAT_HEADER",
    "LOAD_HEADER",
    "MAX_HEADER_CHARS",
    "LoadRule",
    "LoadSignals",
    "MetricsError",
    "MetricsPoller",
    "PodReport",
    "PodState",
    "fetch_metrics",
    "parse_load_header",
    "parse_metrics",
]
