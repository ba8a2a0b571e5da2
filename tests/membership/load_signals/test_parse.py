"""Reading what a pod says (membership/load_signals/parse.py): the ORCA header and the
/metrics page, hostile input included, bounded in items, lines and time."""

from __future__ import annotations

import time

import pytest

from prefix_sidecar.membership.load_signals import (
    MAX_HEADER_CHARS,
    PodReport,
    fetch_metrics,
    parse_load_header,
    parse_metrics,
)
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator

from .conftest import VLLM_JSON, VLLM_PAGE, VLLM_TEXT

# --- the header -------------------------------------------------------------------------------


def test_vllm_text_and_json_headers_parse_alike() -> None:
    expected = PodReport(waiting=3.0, kv_usage=0.42)
    assert parse_load_header(VLLM_TEXT) == expected
    assert parse_load_header(VLLM_JSON) == expected
    assert parse_load_header("text named_metrics.num_requests_waiting=0.0") == PodReport(
        waiting=0.0
    )


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "BIN AAAA",
        "TEXT",
        "TEXT cpu_utilization=0.5",  # ORCA fields we do not use
        "TEXT named_metrics.num_requests_waiting=nan",
        "TEXT named_metrics.num_requests_waiting=inf",
        "TEXT named_metrics.num_requests_waiting=-1",
        "TEXT named_metrics.num_requests_waiting=1e300",
        "TEXT named_metrics.kv_cache_usage_perc=1.5",
        "TEXT named_metrics.num_requests_waiting=3=4",
        "TEXT named_metrics.num_requests_waiting",
        "JSON {",
        "JSON []",
        'JSON {"named_metrics": [1, 2]}',
        'JSON {"named_metrics": {"num_requests_waiting": true}}',
        'JSON {"named_metrics": {"num_requests_waiting": "3"}}',
        'JSON {"named_metrics": {"num_requests_waiting": ' + "9" * 500 + "}}",
        "JSON " + "[" * 5000,  # deep nesting: refused, not a RecursionError
        "TEXT named_metrics.num_requests_waiting=1" + "," * MAX_HEADER_CHARS,  # too long
    ],
)
def test_hostile_or_useless_headers_say_nothing(value: str | None) -> None:
    assert parse_load_header(value) is None


def test_a_bad_value_drops_only_itself() -> None:
    header = "TEXT named_metrics.kv_cache_usage_perc=oops, named_metrics.num_requests_waiting=2"
    assert parse_load_header(header) == PodReport(waiting=2.0)


def test_header_parsing_is_bounded_in_items_and_time() -> None:
    # Many items within the size limit: only the first MAX_HEADER_ITEMS are looked at.
    items = ", ".join(["named_metrics.x=1"] * 40 + ["named_metrics.num_requests_waiting=5"])
    assert len(items) < MAX_HEADER_CHARS
    assert parse_load_header("TEXT " + items) is None
    started = time.perf_counter()
    for _ in range(1000):
        parse_load_header("TEXT " + "a" * (MAX_HEADER_CHARS - 5))
    assert time.perf_counter() - started < 1.0  # linear: ~us each


# --- /metrics ---------------------------------------------------------------------------------


def test_metrics_page_adds_engines_and_takes_the_smallest_kv() -> None:
    report = parse_metrics(VLLM_PAGE)
    assert report == PodReport(running=7.0, waiting=1.0, kv_usage=0.5, kv_tokens=320_000)


@pytest.mark.parametrize(
    "page",
    [
        "",
        "vllm:num_requests_running{",
        'vllm:num_requests_running{model_name="m"}',
        "vllm:num_requests_running NaN",
        "vllm:num_requests_waiting -3",
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0',
        'vllm:cache_config_info{block_size="0",num_gpu_blocks="10"} 1.0',
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="' + "9" * 30 + '"} 1.0',
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="-5"} 1.0',
        "not_vllm:num_requests_running 3",
    ],
)
def test_bad_metrics_lines_are_ignored(page: str) -> None:
    assert parse_metrics(page) == PodReport()


def test_metrics_parsing_stays_linear_on_hostile_labels() -> None:
    # Unclosed quotes and backslashes: the label pattern has no nested quantifier to explode.
    line = 'vllm:cache_config_info{block_size="16' + "\\" * 4000 + 'a="' * 1000 + "} 1\n"
    started = time.perf_counter()
    parse_metrics(line * 20)
    assert time.perf_counter() - started < 0.5


async def test_emulator_page_parses() -> None:
    config = EmulatorConfig(kv_tokens=160_000)
    async with run_emulator(config) as url, UpstreamClient() as client:
        report = await fetch_metrics(client, url, timeout_s=2.0)
    assert report == PodReport(running=0.0, waiting=0.0, kv_usage=0.0, kv_tokens=160_000)
