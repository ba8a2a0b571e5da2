"""Real llama.cpp pods: prefix affinity beats round-robin on TTFT, measured, no sidecar.

Three pods, three ~2,000-token prefixes, interleaved requests with fresh suffixes. With
affinity (prefix i -> pod i) each pod evaluates its prefix once and then only suffixes;
round-robin scatters prefixes, so a pod mostly finds a different prefix in its cache.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from prefix_sidecar_tools.realengine.pods import LlamaFleet, parse_prompt_evals
from prefix_sidecar_tools.realengine.workload import (
    affinity,
    build_requests,
    count_tokens,
    evaluated_by_pod,
    round_robin,
    run_workload,
    summarize,
)
from tests.tools.realengine.conftest import needs_llama

PODS = 3
ROUNDS = 10
PREFIX_WORDS = 2000
SUFFIX_BOUND = 64  # a suffix is 16 words + " query": far below this many tokens


@pytest.mark.real_engine
@pytest.mark.timeout(90)
@needs_llama
async def test_affinity_beats_round_robin(model_path: Path, tmp_path: Path) -> None:
    requests = build_requests(PODS, ROUNDS, prefix_words=PREFIX_WORDS)
    fleet = LlamaFleet(model_path, n=PODS, n_ctx=4096, log_dir=tmp_path)
    async with fleet, aiohttp.ClientSession() as session:
        prefix_tokens = await count_tokens(session, fleet.urls[0], requests[0].prompt)
        rr = await run_workload(fleet, requests, round_robin(fleet.urls), session=session)
        # a different prefix on every pod between the runs, so affinity starts cold too
        for i, url in enumerate(fleet.urls):
            wipe = build_requests(1, 1, prefix_words=PREFIX_WORDS, seed=100 + i)
            await run_workload(fleet, wipe, affinity([url]), session=session)
        aff = await run_workload(fleet, requests, affinity(fleet.urls), session=session)

    rr_sum, aff_sum = summarize(rr), summarize(aff)
    print(f"\nprompt ~{prefix_tokens} tokens, {len(requests)} requests per routing")
    print(rr_sum.line("round-robin"))
    print(aff_sum.line("affinity"))
    print(f"TTFT speed-up (median): {rr_sum.median_ttft_ms / aff_sum.median_ttft_ms:.1f}x")
    print("evaluated tokens by pod and prefix, affinity:", evaluated_by_pod(aff))
    print("evaluated tokens by pod and prefix, round-robin:", evaluated_by_pod(rr))

    assert prefix_tokens > 1500, "the prefix must be long enough for prefill to dominate"
    assert all(len(r.evals) == 1 for r in rr + aff), "each request leaves one log record"
    assert aff_sum.median_ttft_ms * 4 < rr_sum.median_ttft_ms
    assert aff_sum.reuse_ratio > 0.8
    assert rr_sum.reuse_ratio < 0.5

    # with affinity a pod evaluates its own prefix once, then only the new suffixes
    for url in fleet.urls:
        mine = [r for r in aff if r.url == url]
        assert {r.request.prefix_id for r in mine} == {fleet.urls.index(url)}
        assert mine[0].evaluated is not None and mine[0].evaluated > 1500
        assert all(r.evaluated is not None and r.evaluated < SUFFIX_BOUND for r in mine[1:])


def test_parser_reads_cold_warm_and_ram_cache_records() -> None:
    log = "\n".join(
        [
            'INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK',
            "Llama._create_completion: cache miss",
            "llama_perf_context_print: prompt eval time =   80.51 ms /  2003 tokens (x)",
            "llama_perf_context_print:        eval time =    1.22 ms /     3 runs   (x)",
            "llama_perf_context_print:       total time =   84.13 ms /  2008 tokens",
            "Llama.generate: 2001 prefix-match hit, remaining 2 prompt tokens to eval",
            "llama_perf_context_print: prompt eval time =    0.45 ms /     2 tokens (x)",
            "llama_perf_context_print:       total time =    4.79 ms /     7 tokens",
            "Llama._create_completion: cache hit",
            "Llama.generate: 1990 prefix-match hit, remaining 13 prompt tokens to eval",
            "llama_perf_context_print: prompt eval time =    1.00 ms /    13 tokens (x)",
            "llama_perf_context_print:       total time =    5.00 ms /    17 tokens",
        ]
    )
    cold, warm, ram = parse_prompt_evals(log)
    assert (cold.evaluated, cold.reused, cold.ram_cache_hit) == (2003, 0, False)
    assert (warm.evaluated, warm.reused, warm.prompt_tokens) == (2, 2001, 2003)
    assert (ram.evaluated, ram.reused, ram.ram_cache_hit) == (13, 1990, True)
    assert cold.total_ms == pytest.approx(84.13)
