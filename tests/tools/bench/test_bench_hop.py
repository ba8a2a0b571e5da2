"""`prefix-sidecar bench hop --quick`: echo server, sidecar (with its OpenAI HTTP front), bare
HTTP proxies (aiohttp and raw sockets) and pod are real processes.

Checks that every mode was measured and the report is well-formed, not the targets.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from prefix_sidecar_tools.bench.hop import FRAME_MODES, MODES, PATHS
from tests.cli import run_cli

# Load or timing measured on a shared machine: `make test` runs these alone, one at a time.
pytestmark = pytest.mark.timing


def test_quick_hop_report_is_well_formed(tmp_path: Path) -> None:
    report_path = tmp_path / "hop.json"
    done = run_cli("bench", "hop", "--quick", "--frame-ab", "--json", str(report_path))
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    assert set(report["latency"]) == {*MODES, *FRAME_MODES}
    for mode, stats in report["latency"].items():
        assert stats["n"] == 30, mode
        assert 0 < stats["p50_us"] <= stats["p99_us"], mode
        assert math.isfinite(stats["p99_us"]), mode
    for name, value in report["ratios"].items():
        assert math.isfinite(value) and value > 0, name
    assert math.isfinite(report["sidecar_overhead_ms"]["p50"])
    assert set(report["http_overhead_ms"]) == {"http", "proxy", "raw", *FRAME_MODES}
    assert all(math.isfinite(v["p50"]) for v in report["http_overhead_ms"].values())
    assert set(report["throughput"]) == set(PATHS) == {"grpc", "http", "proxy"}
    for path, rate in report["throughput"].items():
        assert rate["callers"] == 4 and 0.9 <= rate["seconds"] < 10, path
        assert rate["errors"] == 0 and rate["requests"] > 0, path
        assert rate["requests_per_s"] > 0 and 0 < rate["p50_ms"] <= rate["p99_ms"], path
    wire = report["thin_saving"]["request_bytes"]
    assert wire["thin"] < 2_000 < 240_000 < wire["fat"]
    breakdown = report["route_breakdown_us"]
    assert len(breakdown) >= 6 and all(v > 0 for v in breakdown.values())
    assert [isinstance(t["met"], bool) for t in report["targets"]] == [True] * 4
    assert "HTTP front TTFT overhead" in report["targets"][2]["name"]
    assert "below the bare aiohttp proxy's" in report["targets"][3]["name"]
    texts = ("Route / echo", "targets", "OpenAI HTTP front", "bare aiohttp proxy", "req/s")
    for text in (*texts, "server frame A/B", "aiohttp's low-level server"):
        assert text in done.stdout, text


@pytest.mark.parametrize(
    ("option", "value"),
    [("--iterations", "0"), ("--callers", "0"), ("--throughput-seconds", "0")],
)
def test_bad_options_are_refused(option: str, value: str) -> None:
    done = run_cli("bench", "hop", option, value, timeout=30)
    assert done.returncode == 2
    assert option in done.stderr
