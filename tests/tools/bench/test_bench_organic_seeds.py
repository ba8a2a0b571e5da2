"""`bench organic --seeds`: the seeds parsed, the TTFTs pooled by hand, and a real two-seed
run (emulator pods, the radix router) whose pooled figures are its seeds' together."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from prefix_sidecar_tools.bench.organic_seeds import (
    pooled,
    pooled_targets,
    render_pooled,
    seed_list,
)
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


def _precise_and_sglang(precise: list[float], sglang: list[float], fraction: float) -> Any:
    def run(values: list[float], fraction: float) -> dict[str, Any]:
        return {"ttft_ms": {"p99": percentile(values, 99), "values": values}, "fraction": fraction}

    return {"paths": {"http-chat": {"precise": run(precise, fraction), "sglang": run(sglang, 1.0)}}}


def test_pooled_targets_compare_the_pooled_p99_and_every_seeds_hit() -> None:
    # seed 0: precise's two slowest requests are slower than SGLang's (its own p99 loses);
    # seed 1: SGLang has three slow ones. Pooled, precise's p99 (the 198th of 200) is 100 ms
    # against SGLang's 500: met, where the first trace's p99 alone says otherwise.
    first = _precise_and_sglang([100.0] * 98 + [600.0] * 2, [100.0] * 98 + [500.0] * 2, 0.995)
    second = _precise_and_sglang([100.0] * 100, [100.0] * 97 + [500.0] * 3, 0.989)
    assert first["paths"]["http-chat"]["precise"]["ttft_ms"]["p99"] > 500.0
    targets = pooled_targets(pooled([first, second]), 4)
    p99 = next(t for t in targets if "TTFT" in t["name"])
    assert p99["met"] and p99["measured"] == "100 vs 500 ms"
    hit = next(t for t in targets if "hit" in t["name"])
    assert not hit["met"] and hit["measured"] == "0.995 0.989"  # one seed under 0.99
    report = {"seeds": {"0": first, "1": second}, "pooled": pooled([first, second]),
              "targets": targets, "wall_s": 1.0}  # fmt: skip
    text = render_pooled(report)
    assert "targets (pooled over the seeds)" in text
    assert "http-chat precise: TTFT p99 over the seeds no worse" in text and " - MET" in text
    assert "0.995 0.989 - NOT MET" in text


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
    assert report["targets"] == []  # the radix router alone: no precise target to report
