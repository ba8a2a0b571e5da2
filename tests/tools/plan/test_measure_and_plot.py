"""`--measure` runs the sidecar's own router (either core) on a small mix; `--plot` writes
a PNG."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from prefix_sidecar_tools.plan.measure import measure
from prefix_sidecar_tools.plan.scenario import Pod, Prefix, Scenario, ScenarioError, Traffic
from tests.cli import run_cli

MIX = (
    Prefix("rules", 8_000, 0.6),
    Prefix("script", 2_000, 0.2),
    Prefix("annex-a", 2_000, 0.1),
    Prefix("annex-b", 2_000, 0.1),
)
SCENARIO = Scenario(
    traffic=Traffic(peak_rps=40.0, prefixes=MIX, output_tokens=16),
    pod=Pod(kv_tokens=60_000, max_running=256, decode_tps=15.0),  # 1 s streams
)


def slow(scenario: Scenario, kv_tokens: int = 60_000) -> Scenario:
    """5 s streams: 50 in flight per pod at 40 req/s over 4 pods."""
    pod = dataclasses.replace(scenario.pod, decode_tps=3.0, kv_tokens=kv_tokens)
    return dataclasses.replace(scenario, pod=pod)


def test_measure_places_replicas_and_mostly_hits() -> None:
    measured = measure(SCENARIO, 4, {"rules": 3, "script": 1, "annex-a": 1, "annex-b": 1})
    assert measured.replicas["rules"] == 3
    assert measured.replicas["annex-a"] == 1
    assert len(measured.ttfts_s) > 10_000
    assert 0.9 <= measured.token_hit_rate <= 1.0
    assert set(measured.hit_rates) == {p.name for p in MIX}
    assert 1.0 <= measured.max_over_mean <= 1.6


def test_measure_overload_spills_and_misses() -> None:
    """Each request held 5 s at 40 req/s over 4 pods: 50 in flight per pod; one replica of
    the rules (60 % of traffic) is over the bounded-load cap, so it spills. With KV for the
    in-flight requests and little more, a spilled prefix evicts another that then misses."""
    roomy = measure(slow(SCENARIO), 4, {"rules": 1, "script": 1, "annex-a": 1, "annex-b": 1})
    assert roomy.spills > 0
    assert roomy.token_hit_rate == 1.0  # a spill warms its pod, and everything fits
    assert roomy.max_over_mean == pytest.approx(1.25, abs=0.05)  # the bounded-load cap
    tight = slow(SCENARIO, kv_tokens=25_000)
    cramped = measure(tight, 4, {"rules": 1, "script": 1, "annex-a": 1, "annex-b": 1})
    assert 0.9 < cramped.token_hit_rate < 1.0
    assert min(cramped.hit_rates.values()) < 1.0


def test_measure_refuses_a_huge_fleet() -> None:
    with pytest.raises(ScenarioError, match="up to 512 pods"):
        measure(SCENARIO, 10_000, {})


def test_cli_measure(tmp_path: Path) -> None:
    done = run_cli(
        "plan",
        "--peak-rps", "40",
        "--prefix", "rules:8000:0.6",
        "--prefix", "script:2000:0.4",
        "--output-tokens", "16",
        "--max-running", "256",
        "--slo-ms", "300",
        "--measure",
        "--json",
        "--samples", "5000",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["scenario"]["routing"]["source"].startswith("--measure: routing core")
    sidecar = data["columns"][1]
    assert sidecar["replicas"]["rules"] >= 1
    assert 0.5 <= data["token_hit_rate"] <= 1.0
    assert any(n.startswith("fleet model (the real router") for n in sidecar["notes"])


def test_cli_plot_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "plan.png"
    done = run_cli(
        "plan", "--preset", "note", "--samples", "2000", "--plot", str(path), timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
