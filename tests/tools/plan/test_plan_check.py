"""`prefix-sidecar bench plan-check --quick`: a real emulated fleet, the real sidecar, five
short bench fleet runs, then the planner's fleet model on each. Checks the report's shape
and the model's own properties, not the ±25 % (a seconds-long run on a shared box cannot
judge that; docs/benchmarks.md has the full run)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.cli import run_cli


@pytest.mark.slow  # ~45 s: five fleet runs
def test_quick_plan_check_and_replay(tmp_path: Path) -> None:
    path = tmp_path / "check.json"
    done = run_cli("bench", "plan-check", "--quick", "--json", str(path), timeout=240)
    assert done.returncode == 0, done.stderr
    assert "QPS/pod@SLO" in done.stdout
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert [(r["policy"], round(r["utilisation"], 2)) for r in rows] == [
        ("round_robin", 0.65),
        ("round_robin", 0.85),
        ("prefix_affinity", 0.65),
        ("prefix_affinity", 0.85),
    ]
    assert report["hop_ms"] >= 0
    params = report["params"]
    warm_ms = 12 + 200 / params["prefill_tps"] * 1e3  # an idle pod's warm prefill
    for row in rows:
        for key in ("predicted_p50_ms", "predicted_p99_ms", "predicted_qps_per_pod_at_slo"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["predicted_p99_ms"] >= row["predicted_p50_ms"]
        # no prediction is faster than an idle pod's warm prefill
        assert row["predicted_p50_ms"] >= warm_ms - 1
        assert (
            row["met"] == (abs(row["p99_ratio"] - 1) <= 0.25 and abs(row["qps_ratio"] - 1) <= 0.25)
            or row["bench"]["results"][row["policy"]]["ttft_ms"]["lower_bound"]
        )
    for low, high in ((rows[0], rows[1]), (rows[2], rows[3])):
        assert high["predicted_p50_ms"] >= low["predicted_p50_ms"]  # more load, more queue
    low, high = row["predicted_p99_band_ms"]
    assert low <= high
    # the model is deterministic: replaying the saved runs predicts the same numbers
    again = tmp_path / "again.json"
    done = run_cli("bench", "plan-check", "--replay", str(path), "--json", str(again))
    assert done.returncode == 0, done.stderr
    replayed = json.loads(again.read_text())["rows"]
    for first, second in zip(rows, replayed, strict=True):
        assert second["predicted_p99_ms"] == pytest.approx(first["predicted_p99_ms"])
        assert second["predicted_qps_per_pod_at_slo"] == pytest.approx(
            first["predicted_qps_per_pod_at_slo"]
        )


def test_bad_loads_exit_2() -> None:
    done = run_cli("bench", "plan-check", "--low", "0.9", "--high", "0.5")
    assert done.returncode == 2
    assert "need 0 < --low < --high < 1" in done.stderr
