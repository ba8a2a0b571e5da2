"""The emulator against a real vLLM pod: one trace replayed on both (prefixes, thin queries,
chat sessions, evictions), and `plan --from-metrics` reading the same pod.

One pod of its own for this module (a small KV cache, so that the trace evicts): the
package's two-pod fleet has a cache too large to fill in a test's time.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from prefix_sidecar_tools.vllm.fidelity import KV_BLOCKS, fidelity_pod, run_fidelity
from prefix_sidecar_tools.vllm.fleet import VllmFleet, vllm_python
from prefix_sidecar_tools.vllm.reports import cache_counters, complete
from prefix_sidecar_tools.vllm.tiny_model import document
from tests.cli import run_cli
from tests.vllm.conftest import VLLM_TESTS, processes_within

# The pod's start runs inside the first test's time, and may take minutes on a busy machine.
pytestmark = [mark for mark in VLLM_TESTS if mark.name != "timeout"] + [pytest.mark.timeout(900)]


@pytest_asyncio.fixture(scope="module", loop_scope="package")
async def small_pod() -> AsyncIterator[VllmFleet]:
    python = vllm_python()
    assert python is not None
    started = time.monotonic()
    async with fidelity_pod(python) as running:
        print(f"\nvLLM fidelity pod ready in {time.monotonic() - started:.1f} s")
        yield running
    assert not processes_within(running.scratch), "vLLM processes outlived the pod"


async def test_the_emulator_matches_vllm_where_routing_reads_it(small_pod: VllmFleet) -> None:
    report = await run_fidelity(small_pod.urls[0], small_pod.model, key=f"t{time.time_ns()}")
    print("\n" + report.table())
    rows = {row.what: row for row in report.rows}
    differ = [row for row in report.rows if row.routing and not row.same]
    assert not differ, "\n".join(f"{r.what}: vLLM {r.vllm} | emulator {r.emulator}" for r in differ)
    # The trace did what it is for: eviction on both pods, in LRU order, real hits before it.
    assert rows["first to lose blocks (LRU)"].vllm == "B"
    outcomes = rows["cache outcome per request"].vllm.split()
    assert outcomes[1] == "full" and "partial" in outcomes and "none" in outcomes
    assert report.vllm_kv_tokens == KV_BLOCKS * report.block_size == 8192


async def test_plan_from_metrics_reads_the_real_pod(small_pod: VllmFleet) -> None:
    url = small_pod.urls[0]
    prompt = document(f"plan-{time.time_ns()}", 1500)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for _ in range(2):  # a miss, then whole blocks cached
            await complete(session, url, small_pod.model, prompt)
        counters = await cache_counters(session, url)
    done = run_cli(
        "plan", "--prefix-tokens", "2000", "--query-tokens", "20", "--output-tokens", "1",
        "--slo-ms", "8000", "--samples", "5000", "--json", "--from-metrics", f"{url}/metrics",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    scenario = json.loads(done.stdout)["scenario"]
    assert scenario["pod"]["kv_tokens"] == counters.kv_tokens == 8192
    share = 2000 / 2020  # prefix / (prefix + query) of the scenario
    expected = min(1.0, counters.hits / (counters.queries * share))
    assert 0 < scenario["routing"]["hit_rate"] == pytest.approx(expected)
    assert "vLLM pod: 8,192 KV tokens in blocks of 128" in scenario["routing"]["source"]
