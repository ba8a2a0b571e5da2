"""Prometheus metrics of one sidecar, served as text on the metrics port.

series: every series' name, help and labels; registry: `Metrics`, the memo, the cost model
and the sweep that keeps label sets bounded; scrape_time: series read from routing state
when scraped; endpoint: the metrics port. Every name callers use is importable from here.
"""

from prefix_sidecar.metrics.endpoint import start_metrics_server
from prefix_sidecar.metrics.registry import Metrics
from prefix_sidecar.metrics.scrape_time import OrganicState, PoolState
from prefix_sidecar.metrics.series import FRONT_GRPC, FRONT_HTTP

__all__ = [
    "FRONT_GRPC",
    "FRONT_HTTP",
    "Metrics",
    "OrganicState",
    "PoolState",
    "start_metrics_server",
]
