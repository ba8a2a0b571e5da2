"""The sidecar in front of real llama.cpp pods: each pod only evaluates its own prefix.

Four pods, four ~2,000-token prefixes, ten rounds of interleaved requests with fresh
suffixes. Through the sidecar (RegisterPrefix with prewarm, then Complete with the prefix
id and the suffix) every request lands on its prefix's home pod, which already holds that
prefix: after the prewarm no pod evaluates a prefix again. Round-robin straight to the same
pods (restarted: cold caches) scatters the prefixes, and most requests pay a full prefill.

Placement: a llama.cpp pod keeps one prompt's KV (its RAM cache is an LRU of requests, and
sized for two prefixes per pod it would serve round-robin nearly as well). So the four
prefix texts are chosen so that the routing contract gives them four different home pods;
the router itself is untouched and the test checks the sidecar agrees with the contract.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import aiohttp
import pytest

from prefix_sidecar_tools.realengine.pods import LlamaFleet, PromptEval
from prefix_sidecar_tools.realengine.workload import (
    build_requests,
    evaluated_by_pod,
    round_robin,
    run_workload,
    summarize,
)
from tests.tools.realengine.conftest import needs_llama

PODS = 4
PREFIXES = 4
ROUNDS = 10
PREFIX_WORDS = 2000
SUFFIX_BOUND = 64  # a suffix is " query" + 16 words: far below this many tokens
COLD = 1500  # a record evaluating more than this many tokens evaluated a whole prefix


def reuse(evals: dict[str, list[PromptEval]]) -> tuple[int, int, float]:
    """(evaluated, reused, reused share) over whole pod logs: prewarm included."""
    records = [e for pod in evals.values() for e in pod]
    evaluated = sum(e.evaluated for e in records)
    reused = sum(e.reused for e in records)
    return evaluated, reused, reused / (evaluated + reused)


@pytest.mark.real_engine
@pytest.mark.timeout(90)
@needs_llama
async def test_sidecar_keeps_each_prefix_on_its_warm_pod(model_path: Path, tmp_path: Path) -> None:
    from prefix_sidecar_tools.realengine.via_sidecar import (
        ViaSidecar,
        contract_homes,
        distinct_home_numbers,
    )

    fleet = LlamaFleet(model_path, n=PODS, n_ctx=4096, log_dir=tmp_path / "logs")
    async with fleet:
        numbers = distinct_home_numbers(fleet.urls, PREFIXES, words=PREFIX_WORDS)
        requests = build_requests(
            PREFIXES, ROUNDS, prefix_words=PREFIX_WORDS, prefix_numbers=numbers
        )
        texts = [next(r.prefix for r in requests if r.prefix_id == i) for i in range(PREFIXES)]

        async with ViaSidecar(fleet, texts) as via:
            prewarmed_marks = via.marks_after_prewarm
            via_results = await run_workload(fleet, requests, send=via.send)
        sidecar_logs = fleet.prompt_evals()
        after_prewarm = {pod.url: pod.prompt_evals(prewarmed_marks[pod.url]) for pod in fleet.pods}

        await fleet.restart()  # same URLs, every cache cold, fresh logs
        async with aiohttp.ClientSession() as session:
            rr_results = await run_workload(
                fleet, requests, round_robin(fleet.urls), session=session
            )
        rr_logs = fleet.prompt_evals()

    via_sum, rr_sum = summarize(via_results), summarize(rr_results)
    via_eval, via_reused, via_share = reuse(sidecar_logs)
    rr_eval, rr_reused, rr_share = reuse(rr_logs)
    print(f"\n{PODS} llama.cpp pods, {PREFIXES} prefixes, {len(requests)} requests per routing")
    print(f"homes: { {i: via.homes[i][0] for i in range(PREFIXES)} }")
    print(
        f"prewarm: {len(via.prewarm)} prefixes in {via.prewarm_s * 1e3:.0f} ms "
        f"({', '.join(f'{w.elapsed_ms:.0f}' for w in via.prewarm)} ms each)"
    )
    print(via_sum.line("sidecar"))
    print(rr_sum.line("round-robin"))
    print(
        f"whole logs: sidecar evaluated {via_eval} reused {via_reused} ({via_share:.1%}), "
        f"round-robin evaluated {rr_eval} reused {rr_reused} ({rr_share:.1%})"
    )
    print(f"TTFT speed-up (median): {rr_sum.median_ttft_ms / via_sum.median_ttft_ms:.1f}x")
    print("evaluated tokens by pod and prefix, sidecar:", evaluated_by_pod(via_results))
    print("evaluated tokens by pod and prefix, round-robin:", evaluated_by_pod(rr_results))

    # the sidecar placed every prefix where routing contract v1 says, one prefix per pod
    expected = contract_homes(fleet.urls, texts)
    assert [via.homes[i] for i in range(PREFIXES)] == expected
    assert len({home[0] for home in expected}) == PREFIXES

    # prewarm: one WARMED event per prefix, on its home, which evaluated the whole prefix
    assert sorted((w.prefix, w.backend, w.state) for w in via.prewarm) == [
        (i, via.homes[i][0], "WARMED") for i in range(PREFIXES)
    ]
    for url, records in sidecar_logs.items():
        warmups = records[: len(records) - len(after_prewarm[url])]
        homed = [i for i in range(PREFIXES) if via.homes[i][0] == url]
        assert len(warmups) == len(homed), f"{url}: {warmups}"
        assert all(w.evaluated > COLD and w.reused == 0 for w in warmups)

    # after the prewarm: every request on its prefix's home, one log record each, and no
    # pod evaluates a prefix that is not its own - in fact none evaluates a prefix at all
    assert all(len(r.evals) == 1 for r in via_results + rr_results)
    for r in via_results:
        home = via.homes[r.request.prefix_id]
        assert r.url in home, f"request {r.request.seq} (prefix {r.request.prefix_id}) on {r.url}"
        assert r.evaluated is not None
        assert r.evaluated < SUFFIX_BOUND, f"{r.url} evaluated {r.evaluated} tokens after prewarm"
    for url, records in after_prewarm.items():
        served = [r for r in via_results if r.url == url]
        assert len(records) == len(served), f"{url}: records not from our requests"

    # round-robin on the same pods evaluates prefixes over and over
    rr_cold = [r for r in rr_results if r.evaluated is not None and r.evaluated > COLD]
    assert len(rr_cold) > len(rr_results) / 2
    assert rr_share < 0.5 < 0.8 < via_share

    assert via_sum.median_ttft_ms * 3 <= rr_sum.median_ttft_ms
    # even the sidecar's slow tail is warm: no request pays a prefill (p90, not the max:
    # on a shared 2-core machine one request can lose the CPU for a while)
    via_p90 = sorted(r.ttft_ms for r in via_results)[int(0.9 * len(via_results)) - 1]
    assert via_p90 * 2 < statistics.median(r.ttft_ms for r in rr_cold)


def test_distinct_home_numbers_follow_the_contract() -> None:
    from prefix_sidecar_tools.realengine.via_sidecar import contract_homes, distinct_home_numbers
    from prefix_sidecar_tools.realengine.workload import prefix_text

    urls = [f"http://127.0.0.1:{port}" for port in (40001, 40002, 40003, 40004)]
    numbers = distinct_home_numbers(urls, 4, words=50)
    homes = contract_homes(urls, [prefix_text(n, 50) for n in numbers])
    assert sorted(h[0] for h in homes) == sorted(urls)
    assert numbers == sorted(numbers) and numbers[0] == 0  # the first fitting texts, in order
    with pytest.raises(ValueError, match="distinct homes on 4 pods"):
        distinct_home_numbers(urls, 5)


def test_requests_carry_the_prefix_and_suffix_split() -> None:
    requests = build_requests(2, 2, prefix_words=30, prefix_numbers=[7, 3])
    for r in requests:
        assert r.prompt == r.prefix + r.suffix and r.suffix.startswith(" query ")
    assert {r.prefix_id for r in requests} == {0, 1}
    assert {r.prefix.split(":")[0] for r in requests} == {"rules 7", "rules 3"}
    with pytest.raises(ValueError, match="distinct numbers"):
        build_requests(2, 1, prefix_numbers=[1, 1])
