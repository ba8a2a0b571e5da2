"""`bench organic --seeds`: the seeds parsed, the TTFTs pooled by hand, and a real two-seed
run (emulator pods, the radix router) whose pooled figures are its seeds' together."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from prefix_sidecar_tools.bench.organic_seeds import pooled, render_pooled, seed_list
from prefix_sidecar_tools.percentile import percentile
from tests.cli import run_cli


def test_seeds_are_a_list_or_a_range_of_at_least_two() -> None:
    assert seed_list("0,1,2") == [0, 1, 2]
    assert seed_list("3-5") == [3, 4, 5]
    for bad in ("0", "1,1", "a,b", "5-3", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            seed_list(bad)


def _report(values: list[float], fraction: float) -> dict[str, Any]:
    ttft = {"p99": percentile(values, 99), "values": sorted(values)}
    return {"paths": {"grpc-complete": {"radix": {"ttft_ms": ttft, "fraction": fraction}}}}


def test_pooled_percentiles_are_over_every_seeds_requests() -> None:
    # one seed's 100 requests of 100 ms with one slow one, another's 100 of 200 ms: the pooled
    # p99 is the 198th of 200: 200 ms
    first = _report([100.0] * 99 + [900.0], 1.0)
    second = _report([200.0] * 100, 0.98)
    row = pooled([first, second])["grpc-complete"]["radix"]
    assert row["requests"] == 200
    assert row["p50"] == 200.0 and row["p99"] == 200.0
    assert row["p99_each"] == [100.0, 200.0]
    assert row["fraction_each"] == [1.0, 0.98]
    text = render_pooled({"seeds": {"0": first, "1": second}, "pooled": pooled([first, second]),
                          "wall_s": 1.0})  # fmt: skip
    assert "seeds 0, 1" in text and "100 200 / 1.000 0.980" in text


def test_a_two_seed_run_pools_what_each_seed_measured(tmp_path: Path) -> None:
    report_path = tmp_path / "seeds.json"
    done = run_cli(
        "bench", "organic", "--quick", "--paths", "grpc-complete", "--policies", "radix",
        "--seeds", "0,1", "--json", str(report_path), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    assert list(report["seeds"]) == ["0", "1"]
    assert [report["seeds"][s]["params"]["seed"] for s in ("0", "1")] == [0, 1]
    each = [report["seeds"][s]["paths"]["grpc-complete"]["radix"]["ttft_ms"] for s in ("0", "1")]
    assert each[0]["values"] != each[1]["values"]  # two traces
    row = report["pooled"]["grpc-complete"]["radix"]
    assert row["requests"] == each[0]["requests"] + each[1]["requests"]
    assert row["p99"] == percentile(each[0]["values"] + each[1]["values"], 99)
    assert "bench organic over seeds 0, 1" in done.stdout
