"""`prefix-sidecar bench real --engine vllm`, tiny: two pods of its own, a handful of requests
per system and workload, SGLang's router when it is installed. The JSON must have its
shape, and its figures must be vLLM's: the pods' counters saw the prompts, the sidecar's
prewarmed prefixes came back as cached_tokens, and every pod process is gone at the end.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from prefix_sidecar_tools.harness import child_env, python_command, spawn, terminate
from prefix_sidecar_tools.vllm.fleet import VENV_ENV, vllm_python
from prefix_sidecar_tools.vllm.sglang import sglang_router_available
from tests.vllm.conftest import VLLM_TESTS, processes_within

pytestmark = VLLM_TESTS

REQUESTS = 6
ROW_KEYS = {
    "requests", "errors", "hit_rate", "usage_hit_rate", "ttft_p50_ms", "ttft_p99_ms",
    "requests_per_pod", "queried_tokens", "hit_tokens", "yuan_per_day", "elapsed_s",
}  # fmt: skip


def expected_systems() -> list[str]:
    return ["sidecar", "round-robin", "least-loaded"] + (
        ["sglang"] if sglang_router_available() else []
    )


# ~3 min on a quiet 2-core box (two pod starts of 30-80 s, then 8 short runs); more under load
@pytest.mark.timeout(480)
async def test_a_tiny_bench_writes_vllms_own_figures_per_system(tmp_path: Path) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="br-"))  # short: vLLM's ipc sockets live under it
    report_path = tmp_path / "real.json"
    argv = python_command(
        "-m", "prefix_sidecar.cli", "bench", "real", "--engine", "vllm",
        "--pods", "2", "--prefixes", "2", "--requests", str(REQUESTS), "--rate", "4",
        "--min-prefix-tokens", "1024", "--max-prefix-tokens", "2048",
        "--organic-duration", "2", "--organic-rate", "2", "--cold", "reset",
        "--pods-nice", "3", "--json", str(report_path),
    )  # fmt: skip
    # clean: no PREFIX_SIDECAR_* setting of ours leaks in, but the vLLM venv found here
    env = child_env(clean=True, TMPDIR=str(scratch), **{VENV_ENV: str(vllm_python())})
    process = await spawn(argv, env=env)
    try:
        assert await process.wait() == 0
    finally:
        await terminate(process, 30)
        leftovers = processes_within(scratch)
        shutil.rmtree(scratch, ignore_errors=True)
    assert not leftovers, f"the bench left processes behind: {leftovers}"

    report = json.loads(report_path.read_text())
    assert report["fleet"]["pods"] == 2 and len(report["fleet"]["prefix_tokens"]) == 2
    assert report["fleet"]["nice"] == 3
    kv_tokens, prefix_tokens = report["fleet"]["kv_tokens"], report["fleet"]["prefix_tokens"]
    assert kv_tokens < sum(prefix_tokens), "the prefixes must not all fit in one pod"
    for workload in ("registered", "organic"):
        rows = report["workloads"][workload]
        assert list(rows) == expected_systems()
        for name, row in rows.items():
            assert set(row) >= ROW_KEYS, (workload, name, sorted(row))
            assert row["queried_tokens"] > 0, f"{workload}/{name}: vLLM counted no prompt"
            assert row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0
            assert len(row["requests_per_pod"]) == 2
    registered = report["workloads"]["registered"]
    for name in ("round-robin", "least-loaded"):
        # vLLM's own request counter: each request answered by exactly one pod
        assert sum(registered[name]["requests_per_pod"]) == REQUESTS
        assert registered[name]["errors"] == 0
    sidecar = registered["sidecar"]
    assert sidecar["errors"] == 0 and sidecar["hit_rate"] > 0
    for workload in ("registered", "organic"):
        decision = report["workloads"][workload]["sidecar"]["decision_ms"]  # from its log
        assert 0 <= decision["p50"] <= decision["p99"] <= decision["max"], decision  # 0.1 ms
        assert decision["n"] == report["workloads"][workload]["sidecar"]["requests"]
        assert "decision_ms" not in report["workloads"][workload]["round-robin"]
    assert 0 < sidecar["ceiling"] <= 1
    rows = report["requests"]["registered/sidecar"]
    assert len(rows) == REQUESTS
    # seq, prefix, pod index, prompt tokens, cached tokens, TTFT ms, error. Every prefix is
    # prewarmed; a request whose pod kept it is served the prefix's whole blocks (one that
    # shares a pod with the other prefix may have lost it: the KV budget is tight on purpose)
    whole = [prefix_tokens[prefix] // 128 * 128 for prefix in range(2)]
    assert all(pod in (0, 1) and not error for _, _, pod, _, _, _, error in rows), rows
    assert any(cached >= whole[prefix] for _, prefix, _, _, cached, _, _ in rows), rows
