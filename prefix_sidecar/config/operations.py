"""How the sidecar is run and watched: the metrics port, logs, shutdown grace and the token
prices its cost metrics count in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefix_sidecar.config.checks import ConfigError, as_list
from prefix_sidecar.fields import at_least, coerce_scalar, one_of, setting

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


def _port(value: int) -> str | None:
    return None if 0 <= value < 65536 else f"must be a port number (0 = off), got {value}"


def _log_level(value: str) -> str | None:
    if value.lower() in LOG_LEVELS:
        return None
    return f"must be debug, info, warning or error, got {value!r}"


def _prices(name: str, value: Any) -> tuple[float, float, float]:
    items = as_list(name, value)
    if len(items) != 3:
        raise ConfigError(
            f"config field {name!r} must be three prices, uncached prompt, cached prompt and "
            f"output (e.g. [2.0, 0.2, 6.0]), got {value!r:.80}"
        )
    prices = [coerce_scalar(name, item, float) for item in items]
    for price in prices:
        if price < 0:
            raise ConfigError(f"config field {name!r} must be >= 0, got {price}")
    return prices[0], prices[1], prices[2]


@dataclass(frozen=True)
class OperationsSettings:
    """Metrics, logs, shutdown and prices."""

    metrics_port: int = setting(
        0, "Prometheus /metrics port; 0 = off", flag="--metrics-port", check=_port
    )
    metrics_host: str = setting("127.0.0.1", "the address the metrics port binds")
    grace_s: float = setting(10.0, "seconds to drain streams after SIGTERM", check=at_least(0))
    log_level: str = setting("info", "debug, info, warning or error", check=_log_level)
    log_format: str = setting(
        "text", "text, or json: one JSON object per line", check=one_of(LOG_FORMATS)
    )

    # One price sheet: a provider quotes the three together (docs/mission.md's cost model).
    prices: tuple[float, float, float] = setting(
        (2.0, 0.2, 6.0),
        "yuan per million tokens: uncached prompt, cached prompt, output (the cost metrics)",
        parse=_prices,
    )
