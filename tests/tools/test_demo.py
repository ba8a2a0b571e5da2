"""`prefix-sidecar demo --quick`: real pods, real sidecar processes; the report is well-formed.

Checks the shape and sanity of the numbers (both policies present, finite, in range), not
the targets: a quick run on a shared 2-core box is too short to judge routing quality.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.cli import run_cli


def test_demo_quick_report_is_well_formed(tmp_path: Path) -> None:
    report_path = tmp_path / "demo.json"
    done = run_cli("demo", "--quick", "--json", str(report_path), timeout=90)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for text in ("prewarm, live", "WARMED", "summary", "sidecar", "round-robin", "yuan/day"):
        assert text in out, f"{text!r} missing from the demo output:\n{out}"
    report = json.loads(report_path.read_text())
    assert set(report["results"]) == {"prefix_affinity", "round_robin"}
    for result in report["results"].values():
        assert result["requests"] == 60
        assert 0.0 <= result["hit_rate"] <= 1.0
        for key in ("p50", "p99"):
            assert math.isfinite(result["ttft_ms"][key]) and result["ttft_ms"][key] > 0
        assert sum(result["load"]["per_pod"].values()) >= result["answered"]
        assert len(result["load"]["per_pod"]) == 2
        assert 0 < result["cost_yuan_per_day"] <= result["cost_raw_yuan_per_day"]
    route = report["route"]
    assert route["calls"] == 50
    assert 0 < route["decision_ns_p50"] <= route["decision_ns_p99"]
    assert route["round_trip_us_p50"] > 0
    assert report["cost_yuan_per_day"]["raw"] == 2_468_000


def test_demo_rejects_bad_flags() -> None:
    done = run_cli("demo", "--kv-tokens", "1000", timeout=30)
    assert done.returncode == 2
    assert "--kv-tokens" in done.stderr
