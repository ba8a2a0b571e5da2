"""`prefix-sidecar bench fleet --quick`: a real fleet, real sidecar processes, every policy.

Checks that the report is well-formed (all policies, finite numbers in range, JSON and PNG
written), not that the targets are met: a seconds-long run on a shared box cannot judge that.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import pytest

from prefix_sidecar_tools.bench.fleet import (
    BASELINES,
    SIDECAR,
    evaluate_targets,
    multi_name,
    policy_names,
    split_name,
)
from tests.cli import run_cli

# Load or timing measured on a shared machine: `make test` runs these alone, one at a time.
pytestmark = pytest.mark.timing


def _bench(*args: str, timeout: float = 80) -> subprocess.CompletedProcess[str]:
    return run_cli("bench", "fleet", *args, timeout=timeout)


def test_quick_fleet_report_is_well_formed(tmp_path: Path) -> None:
    report_path, plot_path = tmp_path / "fleet.json", tmp_path / "ttft.png"
    outcomes_path = tmp_path / "outcomes.jsonl"
    done = _bench(
        "--quick",
        "--json",
        str(report_path),
        "--plot",
        str(plot_path),
        "--outcomes",
        str(outcomes_path),
        "--sidecar-set",
        "load_poll_interval_s=0.4",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    sidecars = report["params"]["sidecars"]
    expected = [*BASELINES, SIDECAR, multi_name(sidecars)]
    assert list(report["results"]) == expected
    pods = report["params"]["pods"]
    for name, result in report["results"].items():
        assert result["requests"] == report["measured_requests"] > 0, name
        assert 0.0 <= result["hit_rate"] <= 1.0, name
        for key in ("p50", "p90", "p99"):
            assert math.isfinite(result["ttft_ms"][key]) and result["ttft_ms"][key] > 0, name
        assert result["ttft_ms"]["p50"] <= result["ttft_ms"]["p99"]
        assert len(result["load"]["per_pod"]) == pods
        assert result["load"]["max_over_mean"] >= 1.0
        assert math.isfinite(result["requests_per_s"]) and result["requests_per_s"] > 0
        assert 0 < result["cost_yuan_per_day"] <= result["cost_raw_yuan_per_day"] == 2_468_000
    assert report["results"][multi_name(sidecars)]["sidecars"] == sidecars
    assert report["params"]["sidecar_set"] == [["load_poll_interval_s", "0.4"]]
    assert {p["name"] for p in report["prefixes"]} >= {"compliance-rules", "live-stream-script"}
    assert report["prefixes"][0]["tokens"] == 60_000
    assert all(1 <= p["replicas"] <= pods for p in report["prefixes"])
    assert len(report["targets"]) == 4 and all(
        isinstance(t["met"], bool) for t in report["targets"]
    )
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in expected:
        assert name in done.stdout
    assert "targets (as measured in this run)" in done.stdout
    for name, result in report["results"].items():  # the pods' own gauges, sampled
        own = result["pods_own"]
        assert own["samples"] > 0, name
        assert own["peak_in_flight"] >= own["mean_in_flight"] > 0, name
        assert own["peak_waiting"] >= own["mean_waiting"] >= 0, name
        assert result["load_signals"] is True, name
    # every request of every run, warm-up included, one JSON line each
    lines = [json.loads(line) for line in outcomes_path.read_text().splitlines()]
    runs = {line["run"] for line in lines}
    assert runs == set(expected)
    per_run = len(lines) // len(runs)
    assert per_run >= report["measured_requests"]
    answered = [line for line in lines if not line["error"]]
    assert answered and all(
        line["backend"].startswith("http://127.0.0.1:")
        and 0 <= line["cached_tokens"] <= line["prompt_tokens"]
        and line["ttft_s"] > 0
        for line in answered
    )


def test_targets_follow_the_numbers() -> None:
    def result(hit: float, balance: float, p99: float, bound: bool = False) -> dict:
        return {
            "hit_rate": hit,
            "load": {"max_over_mean": balance},
            "ttft_ms": {"p99": p99, "lower_bound": bound},
        }

    good = {
        "round_robin": result(0.9, 1.0, 30_000, bound=True),
        SIDECAR: result(0.99, 1.1, 200),
        multi_name(4): result(0.99, 1.2, 250),
    }
    assert [t["met"] for t in evaluate_targets(good, 4)] == [True, True, True, True]
    bad = {
        "round_robin": result(0.9, 1.0, 2_000),
        SIDECAR: result(0.99, 1.4, 200),
        multi_name(4): result(0.95, 1.2, 250),
    }
    assert [t["met"] for t in evaluate_targets(bad, 4)] == [False, False, False, False]
    # K sidecars: p99 within 1.5x of one sidecar's (and the hit rate kept)
    many = {SIDECAR: result(0.99, 1.1, 200), multi_name(8): result(0.99, 1.1, 301)}
    assert [t["met"] for t in evaluate_targets(many, 4, (8,))] == [True, False]
    many[multi_name(8)] = result(0.99, 1.1, 300)
    assert [t["met"] for t in evaluate_targets(many, 4, (8,))] == [True, True]
    many[multi_name(8)] = result(0.98, 1.1, 300)  # p99 fine, hit rate lost
    assert [t["met"] for t in evaluate_targets(many, 4, (8,))] == [True, False]


def test_runs_with_more_sidecars_and_without_signals_are_named_apart() -> None:
    args = argparse.Namespace(
        sidecars=4, also_sidecars=(8, 4), compare_signals=True, compare_rules=False, policies=None
    )
    names = policy_names(args)
    assert names[len(BASELINES) :] == [
        SIDECAR,
        SIDECAR + "_nosig",
        multi_name(4),
        multi_name(4) + "_nosig",
        multi_name(8),
        multi_name(8) + "_nosig",
    ]
    args.compare_signals, args.compare_rules, args.also_sidecars = False, True, ()
    assert policy_names(args)[len(BASELINES) :] == [
        SIDECAR,
        SIDECAR + "_own",
        SIDECAR + "_sat",
        multi_name(4),
        multi_name(4) + "_own",
        multi_name(4) + "_sat",
    ]
    assert split_name(multi_name(8) + "_nosig") == (SIDECAR, 8, "off")
    assert split_name(multi_name(4) + "_sat") == (SIDECAR, 4, "saturation")
    assert split_name(multi_name(4) + "_own") == (SIDECAR, 4, "own")
    assert split_name(SIDECAR) == (SIDECAR, 1, "fleet")
    assert split_name("round_robin") == ("round_robin", 1, "fleet")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-tokens", "50000"], "--kv-tokens"),
        (["--warmup", "70"], "--warmup"),
        (["--pods", "0"], "--pods"),
    ],
)
def test_bad_flags_are_refused(flags: list[str], message: str) -> None:
    done = _bench(*flags, timeout=30)
    assert done.returncode == 2
    assert message in done.stderr
