"""Log lines for people (`log_format: text`) or for a log pipeline (`log_format: json`).

JSON is one object per line: time (UTC, ISO 8601), level, logger, message, then the event's
own fields when it was logged with `log_fields` (the request log: rpc, prefix, backend,
status, ttft_ms, ...), so a pipeline need not parse key=value text.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

FIELDS_ATTR = "fields"  # the LogRecord attribute that carries an event's fields
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_RESERVED = ("time", "level", "logger", "message")


def log_fields(logger: logging.Logger, level: int, head: str, fields: Mapping[str, Any]) -> None:
    """Log one event: `head k=v k=v ...` as text, each field as its own key in JSON."""
    text = " ".join(f"{name}={_text(value)}" for name, value in fields.items())
    logger.log(level, "%s %s", head, text, extra={FIELDS_ATTR: dict(fields)})


def _text(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record; never raises on a field it cannot encode."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _utc(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in (getattr(record, FIELDS_ATTR, None) or {}).items():
            entry[f"field_{name}" if name in _RESERVED else name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def _utc(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"


def configure(level: str, log_format: str) -> None:
    """Send the root logger's records to stderr in the configured format."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
