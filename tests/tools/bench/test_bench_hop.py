"""`prefix-sidecar bench hop --quick`: echo server, sidecar and pod are real processes.

Checks that every mode was measured and the report is well-formed, not the targets.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from sidecar.tools.bench.hop import MODES

ROOT = Path(__file__).resolve().parents[3]


def test_quick_hop_report_is_well_formed(tmp_path: Path) -> None:
    report_path = tmp_path / "hop.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar.cli",
            "bench",
            "hop",
            "--quick",
            "--json",
            str(report_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    assert set(report["latency"]) == set(MODES)
    for mode, stats in report["latency"].items():
        assert stats["n"] == 30, mode
        assert 0 < stats["p50_us"] <= stats["p99_us"], mode
        assert math.isfinite(stats["p99_us"]), mode
    for name, value in report["ratios"].items():
        assert math.isfinite(value) and value > 0, name
    assert math.isfinite(report["sidecar_overhead_ms"]["p50"])
    wire = report["thin_saving"]["request_bytes"]
    assert wire["thin"] < 2_000 < 240_000 < wire["fat"]
    breakdown = report["route_breakdown_us"]
    assert len(breakdown) >= 6 and all(v > 0 for v in breakdown.values())
    assert [isinstance(t["met"], bool) for t in report["targets"]] == [True, True]
    assert "Route / echo" in done.stdout and "targets" in done.stdout


def test_bad_iterations_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "bench", "hop", "--iterations", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "--iterations" in done.stderr
