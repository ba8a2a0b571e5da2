"""A whole scenario from a YAML file; flags override it; bad files say what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefix_sidecar_tools.plan.scenario import Scenario, ScenarioError, load_yaml, validate
from tests.cli import run_cli

SCENARIO = """
name: double-11
traffic: {peak_rps: 400, query_tokens: 150, output_tokens: 300, slo_ms: 800,
          requests_per_day: 5000000}
prefixes:
  - {name: rules, tokens: 50000, share: 0.7}
  - {name: script, tokens: 10000, share: 0.3, hit_rate: 0.9}
pod: {prefill_tps: 20000, max_running: 128, kv_tokens: 300000, gpus: 2}
routing: {hit_rate: 0.99, miss: whole}
prices: {price_base: 1.0}
"""


def test_yaml_scenario_is_read_whole() -> None:
    scenario = load_yaml(SCENARIO, Scenario())
    validate(scenario)
    assert scenario.name == "double-11"
    assert scenario.traffic.peak_rps == 400
    assert [p.name for p in scenario.traffic.prefixes] == ["rules", "script"]
    assert scenario.pod.gpus == 2 and scenario.pod.prefill_tps == 20_000
    assert scenario.prices.price_base == 1.0
    # token-weighted: (0.7 x 50k x 0.99 + 0.3 x 10k x 0.9) / (35k + 3k)
    assert scenario.token_hit_rate() == pytest.approx((34_650 + 2_700) / 38_000)


def test_cli_reads_the_file_and_flags_win(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO)
    done = run_cli(
        "plan", "--scenario", str(path), "--peak-rps", "800", "--json", "--samples", "5000"
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["scenario"]["traffic"]["peak_rps"] == 800
    sidecar = data["columns"][1]
    assert sidecar["gpus"] == 2 * sidecar["pods"]
    assert set(sidecar["replicas"]) == {"rules", "script"}
    assert data["columns"][0]["yuan_per_day"] > sidecar["yuan_per_day"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("traffic: {peak: 3}", "unknown key traffic.peak"),
        ("pods: {}", "unknown scenario sections"),
        ("traffic: {peak_rps: fast}", "traffic.peak_rps must be a number"),
        ("pod: {max_running: 2.5}", "pod.max_running must be a whole number"),
        ("prefixes: [{name: a}]", "prefixes\\[0\\] needs tokens and share"),
        ("traffic: [1, 2]", "section 'traffic' must be a mapping"),
        ("{", "not valid YAML"),
    ],
)
def test_bad_yaml_says_what(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        load_yaml(text, Scenario())
