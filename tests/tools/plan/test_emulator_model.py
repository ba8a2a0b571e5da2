"""The planner's pod of an emulated pod comes from the emulator's own config and parser."""

from __future__ import annotations

import json

import pytest

from prefix_sidecar_tools.emulator import EmulatorConfig
from prefix_sidecar_tools.plan.emulator_model import pod_from_emulator, pod_from_emulator_flags
from prefix_sidecar_tools.plan.scenario import ScenarioError
from tests.cli import run_cli


def test_every_timing_field_is_the_emulators() -> None:
    config = EmulatorConfig(
        kv_tokens=150_000,
        prefill_tps=2_000.0,
        prefill_overhead_s=0.02,
        prefill_slots=2,
        decode_tps=7.0,
        max_running=99,
    )
    pod = pod_from_emulator(config, overhead_ms=5.0)
    assert (pod.kv_tokens, pod.prefill_tps, pod.prefill_overhead_ms) == (150_000, 2_000.0, 20.0)
    assert (pod.prefill_slots, pod.decode_tps, pod.max_running) == (2, 7.0, 99)
    assert pod.kv_counts_output is False  # the emulator's KV holds prompt blocks only
    assert pod.overhead_ms == 5.0


def test_flags_go_through_the_emulators_parser() -> None:
    pod = pod_from_emulator_flags("--kv-tokens 150000 --prefill-tps 2000 --time-scale 20")
    assert pod.kv_tokens == 150_000 and pod.prefill_tps == 2_000
    defaults = EmulatorConfig()
    assert pod.decode_tps == defaults.decode_tps and pod.max_running == defaults.max_running
    with pytest.raises(ScenarioError, match="not an emulator flag: --gpus 2"):
        pod_from_emulator_flags("--gpus 2")
    with pytest.raises(ScenarioError, match="kv_tokens"):
        pod_from_emulator_flags("--kv-tokens 5")


def test_cli_from_emulator() -> None:
    done = run_cli(
        "plan",
        "--from-emulator", "--kv-tokens 150000 --prefill-tps 2000",
        "--prefix-tokens", "12000",
        "--peak-rps", "20",
        "--slo-ms", "8000",
        "--json",
        "--samples", "5000",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    pod = json.loads(done.stdout)["scenario"]["pod"]
    assert pod["kv_tokens"] == 150_000 and pod["prefill_tps"] == 2_000
