"""How the sidecar is run and watched: the metrics port, logs, shutdown grace and the token
prices its cost metrics count in."""

from __future__ import annotations

from dataclasses import dataclass

from prefix_sidecar.config.checks import NOT_NEGATIVE
from prefix_sidecar.fields import one_of, setting

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


def _port(value: int) -> str | None:
    return None if 0 <= value < 65536 else f"must be a port number (0 = off), got {value}"


def _log_level(value: str) -> str | None:
    if value.lower() in LOG_LEVELS:
        return None
    return f"must be debug, info, warning or error, got {value!r}"


@dataclass(frozen=True)
class OperationsSettings:
    """Metrics, logs, shutdown and prices."""

    metrics_port: int = setting(
        0, "Prometheus /metrics port; 0 = off", flag="--metrics-port", check=_port
    )
    metrics_host: str = setting("127.0.0.1", "the address the metrics port binds")
    grace_s: float = setting(10.0, "seconds to drain streams after SIGTERM", check=NOT_NEGATIVE)
    log_level: str = setting("info", "debug, info, warning or error", check=_log_level)
    log_format: str = setting(
        "text", "text, or json: one JSON object per line", check=one_of(LOG_FORMATS)
    )

    price_base: float = setting(2.0, "yuan per million uncached prompt tokens", check=NOT_NEGATIVE)
    price_cache: float = setting(0.2, "yuan per million cached prompt tokens", check=NOT_NEGATIVE)
    price_out: float = setting(6.0, "yuan per million output tokens", check=NOT_NEGATIVE)
