"""Log lines as text or as one JSON object per line (prefix_sidecar/logs.py)."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from prefix_sidecar.logs import FIELDS_ATTR, TEXT_FORMAT, JsonFormatter, log_fields


def record(**extra: object) -> logging.LogRecord:
    made = logging.LogRecord(
        "sidecar.requests", logging.INFO, __file__, 1, "hello %s", ("world",), None
    )
    for name, value in extra.items():
        setattr(made, name, value)
    return made


def test_json_has_time_level_logger_message() -> None:
    line = JsonFormatter().format(record())
    entry = json.loads(line)
    assert entry.pop("time").endswith("Z")
    assert entry == {"level": "info", "logger": "sidecar.requests", "message": "hello world"}
    assert "\n" not in line


def test_json_carries_an_events_fields_without_overwriting_its_own() -> None:
    fields = {"status": "OK", "ttft_ms": 12.5, "message": "pod words", "odd": object()}
    entry = json.loads(JsonFormatter().format(record(**{FIELDS_ATTR: fields})))
    assert entry["status"] == "OK" and entry["ttft_ms"] == 12.5
    assert entry["message"] == "hello world" and entry["field_message"] == "pod words"
    assert entry["odd"].startswith("<object")


def test_json_exception_is_one_line() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        made = record()
        made.exc_info = sys.exc_info()
    line = JsonFormatter().format(made)
    assert "\n" not in line and "RuntimeError: boom" in json.loads(line)["exception"]


def test_log_fields_text_and_json(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("sidecar.requests")
    with caplog.at_level(logging.INFO, logger="sidecar.requests"):
        log_fields(logger, logging.INFO, "Complete", {"prefix": "", "ttft_ms": 3.14159, "n": 2})
    (made,) = caplog.records
    assert made.getMessage() == "Complete prefix=- ttft_ms=3.1 n=2"
    assert (
        logging.Formatter(TEXT_FORMAT)
        .format(made)
        .endswith("INFO sidecar.requests Complete prefix=- ttft_ms=3.1 n=2")
    )
    entry = json.loads(JsonFormatter().format(made))
    assert entry["prefix"] == "" and entry["ttft_ms"] == 3.14159 and entry["n"] == 2
