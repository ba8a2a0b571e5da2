"""`prefix-sidecar bench core --quick` runs end to end and writes a well-formed report.

Not a timed test: the numbers are only checked for shape and sanity, never for speed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cli import run_cli

IMPLEMENTATIONS = ["cython", "python", "uhashring", "note"]

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("SIDECAR_NO_EXTENSIONS")),
    reason="the core bench measures the extension, which SIDECAR_NO_EXTENSIONS turns off",
)


SCALE = "10,100,400"  # the scaling part, kept small here: the default goes to 5,000 pods


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("bench", "core", "--quick", *args, timeout=120)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    result = _bench("--json", "--scale-pods", SCALE)
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)  # stdout holds only the JSON
    return data


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_report_has_every_section(report: dict[str, Any]) -> None:
    assert {"machine", "params", "definitions", "latency_ns", "rings", "ratios"} <= set(report)
    assert {"targets", "throughput_mb_s", "scaling", "churn"} <= set(report)
    assert report["params"]["quick"] is True
    assert report["params"]["pods"] == [8, 100]
    assert report["machine"]["python"] == sys.version.split()[0]
    assert report["machine"]["cpu"]


def test_latencies_and_ratios(report: dict[str, Any]) -> None:
    for pods in ("8", "100"):
        ops = report["latency_ns"][pods]
        assert set(ops) == {"owner", "pick", "route"}
        for op, by_impl in ops.items():
            assert list(by_impl) == IMPLEMENTATIONS
            assert all(_positive(ns) for ns in by_impl.values()), (pods, op, by_impl)
            for base in ("uhashring", "note"):
                ratio = report["ratios"][pods][op][base]
                assert math.isclose(ratio, by_impl[base] / by_impl["cython"])


def test_targets_are_evaluated_at_100_pods(report: dict[str, Any]) -> None:
    names = [target["name"] for target in report["targets"]]
    assert len(names) == 6 and all("100 pods" in name for name in names[:4])
    assert names[4:] == [
        f"pick() at 400 pods <= 1.5x its cost at 10 ({kind}, total given)"
        for kind in ("ring", "maglev")
    ]
    for target in report["targets"][:4]:  # speed-ups: at least the target
        assert target["met"] == (target["ratio"] >= target["target"])
    for target in report["targets"][4:]:  # growth with the fleet: at most the target
        assert target["met"] == (target["ratio"] <= target["target"])


def test_ring_quality(report: dict[str, Any]) -> None:
    for pods, rings in report["rings"].items():
        assert list(rings) == IMPLEMENTATIONS
        for impl, ring in rings.items():
            assert ring["stray_moves"] == 0, f"{impl} moved keys between survivors at {pods}"
            assert 0 < ring["moved_pct"] < 50
            assert ring["busiest_over_mean"] >= 1.0
            assert _positive(ring["build_ms"])
        # Both twins build the same ring, so the same keys move.
        assert rings["cython"]["points"] == rings["python"]["points"] == int(pods) * 1024
        assert rings["cython"]["moved_pct"] == rings["python"]["moved_pct"]
        assert rings["note"]["points"] == 3 * int(pods)
    assert report["rings"]["100"]["cython"]["busiest_over_mean"] <= 1.10


def test_scaling_and_churn(report: dict[str, Any]) -> None:
    scaling = report["scaling"]
    assert scaling["pods"] == [10, 100, 400] == report["params"]["scale_pods"]
    ops = {"owner", "pick", "pick_summed", "pick_bytes"}
    for pods in ("10", "100", "400"):
        for kind in ("ring", "maglev"):
            by_op = scaling["latency_ns"][pods][kind]
            assert set(by_op) == ops and all(_positive(ns) for ns in by_op.values())
    for kind in ("ring", "maglev"):
        ratios = scaling["ratio_most_over_fewest"][kind]
        latency = scaling["latency_ns"]
        assert math.isclose(
            ratios["pick"], latency["400"][kind]["pick"] / latency["10"][kind]["pick"]
        )
    assert set(report["router_ns"]) == {"one_call", "three_calls"}
    assert all(_positive(ns) for ns in report["router_ns"].values())
    churn = report["churn"]
    assert churn["ring"]["stray_pct"] == 0  # the ring moves only the leaving pod's keys
    assert churn["maglev"]["busiest_over_mean"] <= 1.02
    for moved in churn.values():
        assert 0 < moved["leaving_share_pct"] < 2 and 0 < moved["moved_pct"] < 5


def test_throughput(report: dict[str, Any]) -> None:
    names = set(report["throughput_mb_s"])
    assert {"route_key cython", "route_key python", "prefix_id cython", "prefix_id python"} <= names
    assert all(_positive(mb_s) for mb_s in report["throughput_mb_s"].values())


def test_table_and_json_file(tmp_path: Path) -> None:
    out = tmp_path / "core.json"
    result = _bench("--pods", "8", "--scale-pods", "10,20", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "decision latency" in result.stdout and "busiest/mean" in result.stdout
    assert "not evaluated" in result.stdout  # 100 pods were not measured
    data = json.loads(out.read_text())
    assert "decision cost as the fleet grows" in result.stdout and "churn" in result.stdout
    assert data["params"]["pods"] == [8] and len(data["targets"]) == 2


def test_bad_pods_argument_is_refused() -> None:
    result = _bench("--pods", "8,x")
    assert result.returncode == 2
    assert "--pods wants comma-separated integers" in result.stderr


def test_organic_decision_section(report: dict[str, Any]) -> None:
    """Issue 14's decision time: a 32 KB unregistered prompt, organic and window, timed;
    and a flow's start (a first question), which also balances over the home set; and a
    32 KB chat's next turn, which session follow recalls."""
    organic = report["organic"]
    assert organic["prompt_bytes"] == 32 * 1024 and organic["pods"] == 100
    for routing in ("organic", "organic_start", "organic_chat", "organic_raw_followed", "window"):
        times = organic[routing]
        assert all(_positive(times[q]) for q in ("p50_us", "p99_us", "max_us"))
        assert times["p50_us"] <= times["p99_us"] <= times["max_us"]
    assert 0 < organic["anchor_table_entries"] <= organic["anchor_table_bound"]
    target = organic["target"]
    assert target["met"] == (organic["organic"]["p99_us"] <= 50.0)
