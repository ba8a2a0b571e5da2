"""The caller's traceparent and x-request-id: kept when well formed, dropped otherwise."""

from __future__ import annotations

import pytest

from prefix_sidecar.server.common.trace_context import (
    MAX_REQUEST_ID_CHARS,
    TraceContext,
    valid_request_id,
    valid_traceparent,
)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_w3c_traceparent_is_kept() -> None:
    assert valid_traceparent(TRACEPARENT) == TRACEPARENT


@pytest.mark.parametrize(
    "value",
    [
        "",
        TRACEPARENT.upper(),  # the spec's hex is lowercase
        "01" + TRACEPARENT[2:],  # only version 00 is understood
        TRACEPARENT + "-extra",
        TRACEPARENT + "\n",
        TRACEPARENT[:-1],
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",  # all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",  # all-zero parent id
        "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
        "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        "x" * 10_000,
        b"not a str",
    ],
)
def test_a_malformed_traceparent_is_dropped(value: object) -> None:
    assert valid_traceparent(value) == ""


@pytest.mark.parametrize("value", ["r", "req-42", "a" * MAX_REQUEST_ID_CHARS, "!~{}=/+"])
def test_a_request_id_of_visible_ascii_is_kept(value: str) -> None:
    assert valid_request_id(value) == value


@pytest.mark.parametrize(
    "value",
    [
        "",
        "a" * (MAX_REQUEST_ID_CHARS + 1),
        "has space",
        "line\nbreak",
        "tab\t",
        "nul\x00",
        "del\x7f",
        "ünïcode",
        None,
    ],
)
def test_a_request_id_too_long_or_not_visible_ascii_is_dropped(value: object) -> None:
    assert valid_request_id(value) == ""


def test_from_metadata_reads_the_first_value_of_each_key() -> None:
    metadata = (
        ("user-agent", "grpc-python"),
        ("x-request-id", "first"),
        ("traceparent", TRACEPARENT),
        ("x-request-id", "second"),
    )
    trace = TraceContext.from_metadata(metadata)
    assert trace == TraceContext(TRACEPARENT, "first")
    assert trace.http_headers() == {"traceparent": TRACEPARENT, "x-request-id": "first"}


def test_a_malformed_first_value_is_dropped_not_replaced_by_a_later_one() -> None:
    metadata = (("x-request-id", "bad id"), ("x-request-id", "good"), ("traceparent", "00-x"))
    assert TraceContext.from_metadata(metadata) == TraceContext()


def test_no_metadata_means_no_headers() -> None:
    assert TraceContext.from_metadata(None).http_headers() == {}
    assert TraceContext.from_metadata(()).http_headers() == {}
