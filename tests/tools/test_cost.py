"""docs/mission.md's cost model: exact figures from MISSION.md and a few computed by hand."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from prefix_sidecar_tools.cost import CostParams, daily_cost
from tests.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]


def test_note_figures() -> None:
    report = daily_cost(CostParams(), 0.95)
    assert report.raw == pytest.approx(2_468_000)
    assert report.cached == pytest.approx(416_000)
    assert report.saving == pytest.approx(2_052_000)
    assert round(report.saving_pct, 1) == 83.1


def test_hand_computed_cases() -> None:
    # R = 0.5: prefix 0.06 * (1.0 + 0.1) = 0.066; + 0.0004 + 0.003 = 0.0694 * 2e7
    assert daily_cost(CostParams(), 0.5).cached == pytest.approx(1_388_000)
    # R = 0: the cached formula collapses to the raw one
    no_hits = daily_cost(CostParams(), 0.0)
    assert no_hits.cached == pytest.approx(no_hits.raw)
    assert no_hits.saving_pct == pytest.approx(0.0)
    # R = 1, 1M requests, 10k prefix, 100 user, 50 out, prices 1/0.1/4:
    # raw = 1e6 * (10100 * 1 + 50 * 4) / 1e6 = 10,300; cached = 10000*0.1 + 100 + 200 = 1,300
    tokens = {"prefix_tokens": 10_000, "user_tokens": 100, "output_tokens": 50}
    prices = {"price_base": 1.0, "price_cache": 0.1, "price_out": 4.0}
    report = daily_cost(CostParams(requests_per_day=1e6, **tokens, **prices), 1.0)
    assert (report.raw, report.cached) == pytest.approx((10_300, 1_300))


@pytest.mark.parametrize("hit_rate", [-0.1, 1.5])
def test_bad_hit_rate(hit_rate: float) -> None:
    with pytest.raises(ValueError, match="hit_rate"):
        daily_cost(CostParams(), hit_rate)


def test_negative_param_rejected() -> None:
    with pytest.raises(ValueError, match="price_out"):
        daily_cost(CostParams(price_out=-1), 0.9)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "cost", *args, timeout=30, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    )


def test_cli_prints_note_figures() -> None:
    result = _cli()
    assert result.returncode == 0, result.stderr
    assert "2,468,000" in result.stdout
    assert "416,000" in result.stdout
    assert "83.1 %" in result.stdout


def test_cli_json_and_flags() -> None:
    result = _cli("--json", "--hit-rate", "0.5", "--requests-per-day", "1000000")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["cached"] == pytest.approx(1_388_000 / 20)
    assert data["params"]["requests_per_day"] == 1_000_000


def test_cli_bad_input_says_what_to_fix() -> None:
    result = _cli("--hit-rate", "1.2")
    assert result.returncode == 2
    assert "hit_rate must be within [0, 1]" in result.stderr
