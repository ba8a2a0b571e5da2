"""Impossible scenarios exit 2 and say what is impossible and why (the real CLI)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefix_sidecar_tools.plan.capacity import SIDECAR, Unreachable, plan_column
from prefix_sidecar_tools.plan.scenario import Prefix, Scenario, ScenarioError, Traffic, validate
from tests.cli import run_cli


def test_shares_not_summing_to_one_exit_2() -> None:
    done = run_cli("plan", "--prefix", "rules:60000:0.5", "--prefix", "script:12000:0.3")
    assert done.returncode == 2
    assert "prefix shares sum to 0.8, not 1" in done.stderr
    assert "rules 0.5, script 0.3" in done.stderr


def test_prefix_larger_than_kv_exit_2() -> None:
    done = run_cli("plan", "--prefix-tokens", "500000", "--kv-tokens", "400000")
    assert done.returncode == 2
    assert "prefix 'prefix' is larger than KV" in done.stderr
    assert "no pod can ever hold it" in done.stderr


def test_slo_no_pod_count_can_meet_exit_2() -> None:
    # 60,200 tokens at 16,000 tok/s: even a warm request's 200 tokens + a 1 % tail of cold
    # misses... here with every request missing a quarter of the time, p99 is a cold prefill
    done = run_cli("plan", "--hit-rate", "0.9", "--slo-ms", "500", "--samples", "5000")
    assert done.returncode == 2
    assert "SLO of 500 ms cannot be met at any pod count" in done.stderr
    assert "more pods do not make one prefill faster" in done.stderr


def test_unreachable_slo_raises_in_python() -> None:
    scenario = Scenario(traffic=Traffic(slo_ms=10.0))
    with pytest.raises(Unreachable, match=r"even an idle pod's p99 is 2[45] ms"):
        plan_column(scenario, SIDECAR, samples=2_000)


@pytest.mark.parametrize(
    ("traffic", "message"),
    [
        (Traffic(peak_rps=-1), "traffic.peak_rps must be a number > 0"),
        (Traffic(prefixes=()), "the prefix mix is empty"),
        (Traffic(prefixes=(Prefix("a", 10, 0.5), Prefix("a", 10, 0.5))), "prefix names repeat"),
        (Traffic(prefixes=(Prefix("a", 10, 1.0, 1.5),)), "prefix 'a' hit_rate must be within"),
    ],
)
def test_bad_values_are_named(traffic: Traffic, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        validate(Scenario(traffic=traffic))


def test_bad_flags_and_files(tmp_path: Path) -> None:
    done = run_cli("plan", "--prefix", "rules:lots:1")
    assert done.returncode == 2
    assert "TOKENS, SHARE, HIT are numbers" in done.stderr
    done = run_cli("plan", "--scenario", str(tmp_path / "missing.yaml"))
    assert done.returncode == 2
    assert "cannot read" in done.stderr
    done = run_cli("plan", "--hit-rate", "1.5")
    assert done.returncode == 2
    assert "routing.hit_rate must be within [0, 1]" in done.stderr
    done = run_cli("plan", "--from-emulator", "--kv-tokens 5")
    assert done.returncode == 2
    assert "--from-emulator" in done.stderr
