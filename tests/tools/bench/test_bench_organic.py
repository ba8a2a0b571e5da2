"""`prefix-sidecar bench organic`: the trace, the oracle (hand-computed), the radix-tree
baseline, and the bench end to end (real emulator pods, real sidecar processes)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from prefix_sidecar import _core
from prefix_sidecar_tools.bench.organic import policy_names, previous_turns, ttft_floor_ms
from prefix_sidecar_tools.bench.organic_driver import (
    PATHS,
    TIMEOUT,
    Result,
    bucket_percentile,
    metric_samples,
    post_streamed,
)
from prefix_sidecar_tools.bench.organic_oracle import Ceiling, hit_rate, oracle
from prefix_sidecar_tools.bench.organic_radix import (
    ApproximateRadixTree,
    CacheAwareRouter,
    shared_length,
)
from prefix_sidecar_tools.bench.organic_replay import POLICIES, against_report, replay
from prefix_sidecar_tools.bench.organic_replay import ring_of as replay_ring
from prefix_sidecar_tools.bench.organic_report import _organic_decision_lines, summarize
from prefix_sidecar_tools.bench.organic_targets import evaluate_targets
from prefix_sidecar_tools.bench.organic_trace import CLASSES, TraceParams, build_trace, router_of
from prefix_sidecar_tools.emulator import EmulatorConfig
from prefix_sidecar_tools.emulator.app import run_emulator
from tests.cli import run_cli

ROOT = Path(__file__).resolve().parents[3]
BLOCK = 64  # bytes of one 16-token block at 4 bytes per token

# --- the oracle: hand-computed ---------------------------------------------------------------

# conftest.organic_report: a run -> (the report's path, its pods)
WriteReport = Callable[[dict[str, Any]], tuple[str, list[str]]]


def test_oracle_first_sight_is_a_miss_and_a_repeat_keeps_its_last_token_uncached() -> None:
    three_blocks = "a" * (3 * BLOCK)  # 48 tokens, 3 full blocks
    assert oracle([three_blocks, three_blocks]) == [Ceiling(48, 0), Ceiling(48, 32)]


def test_oracle_counts_leading_shared_blocks_only() -> None:
    base = "a" * (3 * BLOCK)
    longer = base + "b" * BLOCK  # 4 blocks, the first 3 seen
    first_only = "a" * BLOCK + "c" * (2 * BLOCK)  # shares block 0 only
    middle_only = "c" * BLOCK + "a" * (2 * BLOCK)  # block 1 bytes equal base's, chain differs
    partial = "a" * 100  # 25 tokens: one full block, a partial one never cached
    got = oracle([base, longer, first_only, middle_only, partial])
    assert [c.cached_tokens for c in got] == [0, 48, 16, 0, 16]
    assert [c.prompt_tokens for c in got] == [48, 64, 48, 48, 25]
    assert hit_rate(got) == pytest.approx(80 / 233)


def test_oracle_order_matters_the_longer_prompt_first_serves_the_shorter() -> None:
    short, long = "x" * (2 * BLOCK), "x" * (4 * BLOCK)
    assert [c.cached_tokens for c in oracle([long, short])] == [0, 16]  # 2 blocks, cap (32-1)//16
    assert [c.cached_tokens for c in oracle([short, long])] == [0, 32]
    assert hit_rate([]) == 0.0


async def test_one_big_pod_fed_in_order_serves_exactly_the_ceiling() -> None:
    """The oracle is the emulator's own accounting: one pod that never evicts, sent the
    trace one request at a time in nominal order, reports every request's ceiling, on the
    chat body (the pod renders the messages) and on the raw prompt alike."""
    trace = build_trace(TraceParams(seed=5, duration_s=6.0, tenants=4, templates=2))
    ceilings = oracle([r.prompt for r in trace.requests])
    assert any(c.cached_tokens for c in ceilings)
    config = EmulatorConfig(time_scale=1000.0, kv_tokens=4_000_000)
    for chat in (True, False):
        async with run_emulator(config) as url, aiohttp.ClientSession() as session:
            for request, ceiling in zip(trace.requests, ceilings, strict=True):
                result = Result(request.seq, request.kind)
                await post_streamed(
                    session,
                    url,
                    request,
                    result,
                    chat=chat,
                    max_tokens=1,
                    first_token_timeout_s=10.0,
                )
                assert result.ok, result.error
                assert (result.prompt_tokens, result.cached_tokens) == (
                    ceiling.prompt_tokens,
                    ceiling.cached_tokens,
                ), (chat, request.seq)


# --- the trace ---------------------------------------------------------------------------------

SMALL = TraceParams(seed=3, duration_s=20.0, tenants=5, templates=3)


def test_trace_is_seeded_and_tagged() -> None:
    one, two = build_trace(SMALL), build_trace(SMALL)
    assert [r.prompt for r in one.requests] == [r.prompt for r in two.requests]
    other = build_trace(TraceParams(seed=4, duration_s=20.0, tenants=5, templates=3))
    assert [r.prompt for r in other.requests] != [r.prompt for r in one.requests]
    counts = one.counts()
    assert set(counts) == set(CLASSES) and all(counts[k] > 0 for k in CLASSES)
    assert [r.seq for r in one.requests] == list(range(len(one.requests)))
    assert all(300 <= len(s) <= 3000 for s in one.system_prompts)
    nominal = [r.nominal_at for r in one.requests]
    assert nominal == sorted(nominal)


def test_session_turns_extend_the_previous_prompt_and_the_oracle_sees_it() -> None:
    trace = build_trace(SMALL)
    ceilings = oracle([r.prompt for r in trace.requests])
    sessions = [f for f in trace.flows if f.requests[0].kind == "session"]
    assert sessions
    for flow in sessions:
        assert SMALL.min_turns <= len(flow.requests) <= SMALL.max_turns
        assert flow.requests[0].messages[0] == (
            "system",
            trace.system_prompts[flow.requests[0].owner],
        )
        for previous, turn in zip(flow.requests, flow.requests[1:], strict=False):
            assert turn.prompt.startswith(previous.prompt)  # + answer + a new user message
            assert SMALL.min_gap_s <= turn.gap_s <= SMALL.max_gap_s
            assert turn.messages[: len(previous.messages)] == previous.messages
            whole_blocks = len(previous.prompt.encode()) // BLOCK  # a cut last token differs
            assert ceilings[turn.seq].cached_tokens >= 16 * whole_blocks


def test_fewshot_requests_share_their_template_block() -> None:
    trace = build_trace(SMALL)
    fewshot = [r for r in trace.requests if r.kind == "fewshot"]
    assert fewshot
    for request in fewshot:
        template = trace.template_blocks[request.owner]
        shared = template.removesuffix("<|im_start|>assistant\n")
        assert request.prompt.startswith(shared)
        assert request.messages[-1][0] == "user"


def test_trace_params_refuse_nonsense() -> None:
    for bad in (
        TraceParams(duration_s=0),
        TraceParams(tenants=0),
        TraceParams(min_turns=5, max_turns=4),
        TraceParams(tenant_rate=0, fewshot_rate=0, session_rate=0),
        TraceParams(min_gap_s=3, max_gap_s=1),
    ):
        with pytest.raises(ValueError):
            build_trace(bad)


# --- the radix-tree baseline -------------------------------------------------------------------


def test_shared_length_across_chunks() -> None:
    text = "q" * 200 + "x"
    assert shared_length(text, 0, "q" * 200 + "y") == 200
    assert shared_length(text, 10, "q" * 500) == 190
    assert shared_length("abc", 0, "") == 0
    assert shared_length("abc", 3, "abc") == 0


def test_tree_matches_splits_and_counts_characters_per_worker() -> None:
    clock = iter(range(100)).__next__
    tree = ApproximateRadixTree(clock=lambda: float(clock()))
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")  # splits "hello world" after "hello "
    assert tree.prefix_match("hello world, again") == (11, "a")
    assert tree.prefix_match("hello there") == (11, "b")
    assert tree.prefix_match("hello") == (5, "b")  # both went through: the latest wins
    assert tree.prefix_match("goodbye") == (0, None)
    assert tree.tenant_chars == {"a": 11, "b": 11}
    tree.insert("hello world", "b")
    assert tree.tenant_chars == {"a": 11, "b": 16}
    assert tree.smallest_tenant(["b", "a"]) == "a"


def test_eviction_drops_a_workers_least_recently_used_leaves_first() -> None:
    now = [0.0]
    tree = ApproximateRadixTree(clock=lambda: now[0])
    for at, text in enumerate(("sys-A old-turn", "sys-A new-turn", "sys-B")):
        now[0] = float(at)
        tree.insert(text, "w")
    tree.insert("sys-A new-turn", "v")
    assert tree.tenant_chars["w"] == len("sys-") + len("A ") + len("old-turn") + len(
        "new-turn"
    ) + len("B")
    evicted = tree.evict_tenant_by_size(tree.tenant_chars["w"] - 1)
    assert evicted == len("old-turn")  # the oldest leaf, not the newer turn
    assert tree.prefix_match("sys-A old-turn") == (len("sys-A "), "v")  # v touched it last
    assert tree.prefix_match("sys-A new-turn")[0] == len("sys-A new-turn")
    assert tree.evict_tenant_by_size(len("sys-A new-turn")) == len("new-turn")  # w's, not v's
    assert tree.tenant_chars == {"w": len("sys-A B"), "v": len("sys-A new-turn")}
    assert tree.prefix_match("sys-A new-turn") == (len("sys-A new-turn"), "v")
    assert tree.prefix_match("sys-B") == (len("sys-B"), "w")
    assert tree.evict_tenant_by_size(0) == len("sys-A B") + len("sys-A new-turn")
    assert tree.tenant_chars == {"w": 0, "v": 0} and not tree.root.children


def test_router_follows_the_match_above_the_threshold_else_the_emptiest_worker() -> None:
    router = CacheAwareRouter(["p0", "p1", "p2"], cache_threshold=0.5)
    first = router.select("system prompt of tenant one; question 1")
    assert first == "p0"  # all empty: the first worker
    second = router.select("another tenant entirely")
    assert second == "p1"  # no match: the emptiest worker, p0 holds text now
    assert router.select("system prompt of tenant one; question 2") == "p0"  # > 50 % match
    assert router.select("system prompt of tenant two, quite different text") == "p2"
    assert (router.cache_picks, router.smallest_picks, router.balanced_picks) == (1, 3, 0)


def test_router_balances_when_load_is_imbalanced_by_both_thresholds() -> None:
    router = CacheAwareRouter(["p0", "p1"], balance_abs=2, balance_rel=1.5)
    assert router.select("shared prefix one") == "p0"
    for _ in range(3):
        router.started("p0")
    assert router.select("shared prefix one again") == "p1"  # 3 - 0 > 2 and 3 > 0 x 1.5
    assert router.balanced_picks == 1
    router.finished("p0")
    assert router.select("shared prefix one again!") in {"p0", "p1"}
    assert router.balanced_picks == 1  # 2 - 0 is not > 2: back to the tree
    with pytest.raises(ValueError):
        CacheAwareRouter([])


def test_router_evicts_on_its_interval() -> None:
    now = [0.0]
    router = CacheAwareRouter(
        ["p0"], max_tree_chars=10, eviction_interval_s=5.0, clock=lambda: now[0]
    )
    router.select("x" * 50)
    now[0] = 4.0
    router.evict_if_due()
    router.select("y" * 50)
    assert router.evicted_chars == 0
    now[0] = 5.0
    router.evict_if_due()
    # whole leaves go, the least recently used first, until at most 10 characters are left
    assert router.evicted_chars == 100 and router.tree.tenant_chars["p0"] == 0
    router.select("z" * 5)
    router.evict_if_due()  # not due again until 10.0
    assert router.evicted_chars == 100 and router.tree.tenant_chars["p0"] == 5


# --- the report's arithmetic ------------------------------------------------------------


def test_summary_fractions_moves_and_censored_timeouts() -> None:
    ceilings = [Ceiling(100, 0), Ceiling(200, 160), Ceiling(300, 240), Ceiling(100, 80)]
    cached = [0, 160, 120]
    results = [
        Result(0, "session", backend="a", sent_at=0.0, ttft_s=0.9, prompt_tokens=100),
        Result(1, "session", backend="a", sent_at=0.2, ttft_s=0.2, prompt_tokens=200),
        Result(2, "session", backend="b", sent_at=0.3, ttft_s=0.3, prompt_tokens=300),
        Result(3, "tenant", sent_at=0.4, error=TIMEOUT),
    ]
    for result, tokens in zip(results, cached, strict=False):
        result.cached_tokens = tokens
    summary = summarize(
        results,
        ceilings,
        time_scale=10.0,
        timeout_s=2.0,
        pod_requests={"a": 2, "b": 1},
        in_flight={"a": 1.5, "b": 0.5},
        decision_us={"p50": 1.0, "p99": 2.0, "bucketed": False},
        previous_turn=[-1, 0, 1, -1],
        warmup_s=1.0,  # modelled: the first request (sent at 0 s) is left out of TTFT
    )
    assert summary["hit_rate"] == pytest.approx(280 / 700)
    assert summary["ceiling"] == pytest.approx(480 / 700)
    assert summary["fraction"] == pytest.approx(280 / 480)
    assert summary["classes"]["session"]["fraction"] == pytest.approx(280 / 400)
    assert summary["classes"]["tenant"]["hit_rate"] == 0.0  # timed out: nothing cached
    assert math.isnan(summary["classes"]["fewshot"]["fraction"])  # no such requests
    assert summary["session_turns_moved"] == pytest.approx(1 / 2)
    assert summary["ttft_ms"]["requests"] == 3  # 2 s, 3 s and the timeout censored at 20 s
    assert summary["ttft_ms"]["p50"] == pytest.approx(3000.0)
    assert summary["ttft_ms"]["p99"] == pytest.approx(20_000.0)
    assert summary["ttft_ms"]["lower_bound"] is True
    assert summary["ttft_ms_all"]["requests"] == 4
    assert summary["ttft_ms_all"]["p50"] == pytest.approx(3000.0)  # 2, 3, 9, 20 s
    assert summary["load"]["max_over_mean"] == pytest.approx(2 / 1.5)
    assert summary["load"]["in_flight_max_over_mean"] == pytest.approx(1.5)
    assert summary["errors"] == {TIMEOUT: 1}


def test_previous_turns_follow_each_flow() -> None:
    trace = build_trace(SMALL)
    before = previous_turns(trace)
    for flow in trace.flows:
        assert before[flow.requests[0].seq] == -1
        for earlier, later in zip(flow.requests, flow.requests[1:], strict=False):
            assert before[later.seq] == earlier.seq < later.seq


def test_ttft_floor_is_the_prefill_of_what_the_ceiling_leaves_uncached() -> None:
    """The floor: overhead + uncached tokens / prefill rate, for requests after the warm-up;
    a request the ceiling serves whole costs the overhead alone."""
    trace = build_trace(SMALL)
    config = EmulatorConfig(prefill_tps=1000.0, prefill_overhead_s=0.01)
    ceilings = [
        Ceiling(1000, 0) if i % 2 else Ceiling(1000, 1000) for i in range(len(trace.requests))
    ]
    floor = ttft_floor_ms(trace, ceilings, config, warmup_s=0.0)
    assert floor["p50"] == pytest.approx(10.0) and floor["p99"] == pytest.approx(1010.0)
    late = ttft_floor_ms(trace, ceilings, config, warmup_s=1e9)  # nothing after the warm-up
    assert late == {"p50": 0.0, "p99": 0.0}


def test_the_p99_target_says_when_the_window_is_near_the_floor() -> None:
    """Out of reach: the window's p99 under 1.5x the floor; otherwise no note."""

    def report(window_p99: float) -> dict[str, object]:
        def run(p99: float) -> dict[str, object]:
            classes = {k: {"fraction": 1.0} for k in CLASSES}
            return {
                "fraction": 1.0,
                "hit_rate": 0.8,
                "classes": classes,
                "load": {"max_over_mean": 1.0},
                "ttft_ms": {"p99": p99},
            }

        return {
            "params": {"sidecars": 4},
            "ttft_floor_ms": {"p50": 50.0, "p99": 200.0},
            "paths": {"grpc-chat": {"window": run(window_p99), "sidecar": run(250.0)}},
        }

    def p99_target(window_p99: float) -> str:
        targets = evaluate_targets(report(window_p99))
        return next(t["measured"] for t in targets if "TTFT p99" in t["name"])

    assert "out of reach" in p99_target(280.0)  # 1.4x the floor
    assert "out of reach" not in p99_target(320.0)  # 1.6x the floor
    assert "at most 1.60x is possible" in p99_target(320.0)


def test_winners_are_named_for_one_router_and_for_k() -> None:
    """One sidecar against the central radix router, K sidecars against K radix routers with
    a tree each; "split" when each wins one of hit rate and p99."""

    def run(hit: float, p99: float) -> dict[str, object]:
        classes = {k: {"fraction": 1.0} for k in CLASSES}
        load = {"max_over_mean": 1.0}
        return {
            "fraction": 1.0,
            "hit_rate": hit,
            "classes": classes,
            "load": load,
            "ttft_ms": {"p99": p99},
        }

    runs = {
        "sidecar": run(0.80, 500.0),
        "radix": run(0.81, 450.0),
        "sidecar_x4": run(0.80, 500.0),
        "radix_x4": run(0.70, 900.0),
    }
    report = {"params": {"sidecars": 4}, "paths": {"grpc-chat": runs}}
    winners = {t["name"]: t for t in evaluate_targets(report) if "(hit rate and p99)" in t["name"]}
    one = winners["grpc-chat sidecar vs the radix-tree baseline (hit rate and p99)"]
    four = winners["grpc-chat sidecar_x4 vs 4 radix routers, a tree each (hit rate and p99)"]
    assert one["measured"].startswith("winner radix") and not one["met"]
    assert four["measured"].startswith("winner sidecar") and four["met"]
    runs["radix_x4"] = run(0.70, 400.0)
    four = next(t for t in evaluate_targets(report) if "radix routers" in t["name"])
    assert four["measured"].startswith("winner split")


# --- the metrics helpers -------------------------------------------------------------------


def test_decision_histogram_percentiles_are_bucket_bounds() -> None:
    text = (
        "# TYPE prefix_sidecar_decision_seconds histogram\n"
        'prefix_sidecar_decision_seconds_bucket{front="grpc",le="1e-05",rpc="Chat"} 90.0\n'
        'prefix_sidecar_decision_seconds_bucket{front="grpc",le="5e-05",rpc="Chat"} 99.0\n'
        'prefix_sidecar_decision_seconds_bucket{front="grpc",le="+Inf",rpc="Chat"} 100.0\n'
        'prefix_sidecar_decision_seconds_count{front="grpc",rpc="Chat"} 100.0\n'
        'prefix_sidecar_decision_seconds_sum{front="grpc",rpc="Chat"} 0.001\n'
    )
    samples = metric_samples(text, "prefix_sidecar_decision_seconds_bucket")
    buckets = {float(labels["le"]): value for labels, value in samples}
    assert bucket_percentile(buckets, 50) == 1e-5
    assert bucket_percentile(buckets, 99) == 5e-5
    assert bucket_percentile(buckets, 100) == math.inf
    assert math.isnan(bucket_percentile({}, 50))


# --- end to end ----------------------------------------------------------------------------


def _bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_cli("bench", "organic", *args, timeout=timeout)


def _quick(
    tmp_path: Path, path: str, policies: str, *more: str, timeout: float
) -> tuple[subprocess.CompletedProcess[str], dict]:
    """A --quick run of one path and some policies; its stdout and JSON report."""
    report_path = tmp_path / "organic.json"
    done = _bench(
        "--quick", "--paths", path, "--policies", policies, *more,
        "--json", str(report_path), timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done, json.loads(report_path.read_text())


def _check_run(run: dict, requests: int, decided_here: bool = True) -> None:
    assert run["requests"] == requests
    assert run["answered"] == requests, run["errors"]
    assert run["prompt_tokens_mismatched"] == 0  # the pods count tokens as the oracle does
    assert 0.0 < run["hit_rate"] <= run["ceiling"] * 1.05
    for kind in CLASSES:
        assert 0.0 <= run["classes"][kind]["fraction"] <= 1.05
    assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"]
    assert sum(run["load"]["per_pod"].values()) == requests
    assert run["load"]["max_over_mean"] >= 1.0
    if decided_here:  # by the bench or a sidecar it can read; not by SGLang's router
        assert run["decision_us"]["p50"] > 0


def test_quick_one_path_report_is_well_formed(tmp_path: Path) -> None:
    done, report = _quick(tmp_path, "grpc-complete", "window,radix", timeout=60)
    runs = report["paths"]["grpc-complete"]
    assert {"window", "window_x2", "radix", "radix_x2"} <= set(runs)
    requests = report["trace"]["requests"]
    for run in runs.values():
        _check_run(run, requests)
    assert runs["radix"]["decision_us"]["bucketed"] is False
    assert runs["radix_x2"]["decision_us"]["bucketed"] is False
    assert runs["radix"]["sidecars"] == runs["radix_x2"]["sidecars"] == 0
    assert not any("organic_decisions" in run for run in runs.values())  # window, radix
    assert "organic decisions" not in done.stdout
    assert runs["window_x2"]["sidecars"] == 2
    assert 0 < report["ceiling"]["hit_rate"] < 1
    assert "radix" in done.stdout and "oracle ceiling" in done.stdout


def test_sglang_runs_only_when_named_as_its_own_router_process(tmp_path: Path) -> None:
    """`sglang`: SGLang's router (cache_aware, the radix baseline's tree), one process per
    replica in front of the pods. The pods' counters and usage give its loads and hits; it
    does not say which pod answered, so turns moved and decision times are unknown."""
    pytest.importorskip("sglang_router", reason="bench organic's sglang runs: sglang-router")
    assert "sglang" not in policy_names(2, True)
    assert policy_names(2, True, ["sglang"])[-2:] == ["sglang", "sglang_x2"]
    _, report = _quick(tmp_path, "http-chat", "sglang", timeout=180)
    runs = report["paths"]["http-chat"]
    assert set(runs) == {"sglang", "sglang_x2"}
    for run in runs.values():
        _check_run(run, report["trace"]["requests"], decided_here=False)
        assert math.isnan(run["session_turns_moved"]) and math.isnan(run["decision_us"]["p50"])
        assert run["sidecars"] == 0
    assert runs["sglang"]["fraction"] >= 0.9  # one tree sees every prompt


def test_hashed_and_wide_run_only_when_named(tmp_path: Path) -> None:
    """`hashed` and `wide` are the befores of befores/afters on the same pods: organic
    routing with flow starts unbalanced (organic_balance_starts off), and with the spreads
    before sessions got a narrower set than starts; each runs only when named."""
    assert not {"hashed", "wide", "unfollowed"} & set(policy_names(2, True))
    assert policy_names(2, True, ["hashed"])[-2:] == ["hashed", "hashed_x2"]
    assert policy_names(2, True, ["wide"])[-2:] == ["wide", "wide_x2"]
    assert policy_names(2, True, ["unfollowed"])[-2:] == ["unfollowed", "unfollowed_x2"]
    _, report = _quick(tmp_path, "grpc-chat", "sidecar,hashed,wide", timeout=180)
    runs = report["paths"]["grpc-chat"]
    assert set(runs) == {"sidecar", "sidecar_x2", "hashed", "hashed_x2", "wide", "wide_x2"}
    requests = report["trace"]["requests"]
    for run in runs.values():
        _check_run(run, requests)
    assert runs["hashed_x2"]["sidecars"] == runs["wide_x2"]["sidecars"] == 2
    # every request decided once, by one sidecar, counted by kind; hashed never moves a start;
    # then picked once under bounded load (its branch), no pod failing over
    for run in runs.values():
        assert sum(run["organic_decisions"].values()) == requests
        assert sum(run["picks"].values()) == requests
        assert set(run["picks"]) <= {"home", "spill", "fallback"} and run["picks"]["home"] > 0
        assert run["failovers"] == {}
    assert runs["hashed"]["organic_decisions"]["start_moved"] == 0
    assert runs["hashed"]["organic_decisions"]["start_far"] == 0


def test_measure_after_counts_only_the_steady_state(tmp_path: Path) -> None:
    """--measure-after: the whole trace is sent, only requests due after it are measured -
    hit rates against the oracle over those, loads from the pods their answers named."""
    done, report = _quick(tmp_path, "grpc-chat", "sidecar", "--measure-after", "3", timeout=120)
    trace = build_trace(TraceParams.of_settings(report["params"]))
    later = [r for r in trace.requests if r.nominal_at >= 3.0]
    assert 0 < len(later) < len(trace.requests) == report["trace"]["requests"]
    ceilings = oracle([r.prompt for r in trace.requests])
    expected = sum(ceilings[r.seq].cached_tokens for r in later) / sum(
        ceilings[r.seq].prompt_tokens for r in later
    )
    assert report["ceiling"]["hit_rate"] == pytest.approx(expected)
    for run in report["paths"]["grpc-chat"].values():
        _check_run(run, len(later))
        # the sidecars count every decision, warm-up included
        assert sum(run["organic_decisions"].values()) == len(trace.requests)
    assert "organic decisions (the sidecars' counts, whole run):" in done.stdout
    assert "picks: home " in done.stdout
    assert f"steady state: {len(later)} of {len(trace.requests)} requests" in done.stdout


@pytest.mark.slow
def test_quick_every_path_and_policy(tmp_path: Path) -> None:
    report_path = tmp_path / "organic.json"
    done = _bench("--quick", "--json", str(report_path), timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    assert list(report["paths"]) == list(PATHS)
    expected = set(policy_names(2, True))
    requests = report["trace"]["requests"]
    for runs in report["paths"].values():
        assert set(runs) >= expected
        for run in runs.values():
            _check_run(run, requests)
    assert report["targets"] and all(isinstance(t["met"], bool) for t in report["targets"])


def test_bad_arguments_are_refused() -> None:
    done = _bench("--paths", "grpc-nope", timeout=30)
    assert done.returncode == 2 and "--paths has grpc-nope" in done.stderr
    done = _bench("--policies", "dynamo", timeout=30)
    assert done.returncode == 2 and "--policies has dynamo" in done.stderr
    done = _bench("--tenant-rate", "0", "--fewshot-rate", "0", "--session-rate", "0", timeout=30)
    assert done.returncode == 2 and "at least one rate" in done.stderr
    done = _bench("--duration", "20", "--measure-after", "20", timeout=30)
    assert done.returncode == 2 and "--measure-after must be < --duration" in done.stderr


# --- the offline replay ----------------------------------------------------------------------


def test_replay_is_deterministic_and_reads_like_the_bench() -> None:
    """The replay routes the bench's trace through K real OrganicRouters onto the emulator's
    own caches: the same inputs give the same numbers, every fraction is within the ceiling,
    and one router that sends every request to one pod is exactly the ceiling's cache but
    for its capacity."""
    trace = build_trace(TraceParams(seed=3, duration_s=8.0, tenants=6, templates=3))
    ring = replay_ring(4, 0)
    first = replay(trace, ring, 2, chat=True)
    assert first == replay(trace, ring, 2, chat=True)
    for result in (first, replay(trace, ring, 1, chat=False)):
        assert 0.5 < result.fraction <= 1.0 + 1e-9
        assert all(0.0 <= f <= 1.0 + 1e-9 for f in result.classes.values())
        assert result.max_over_mean >= 1.0 and 0.0 <= result.moved <= 1.0
    one = replay(trace, _core.Ring(["http://127.0.0.1:1"]), 1, chat=True, kv_tokens=10**7)
    assert one.fraction == pytest.approx(1.0) and one.max_over_mean == 1.0 and one.moved == 0.0


def test_router_of_spreads_requests_or_pins_flows() -> None:
    """Which sidecar sends a request: drawn per request (the default), or per flow
    (--pin-flows), the same in the bench, the replay and the queue model."""
    trace = build_trace(TraceParams(seed=2, duration_s=20.0, tenants=6, templates=3))
    sessions = [f for f in trace.flows if len(f.requests) > 3]
    assert sessions
    for flow in sessions:
        assert len({router_of(r, 4, pin_flows=True) for r in flow.requests}) == 1
    assert any(len({router_of(r, 4) for r in flow.requests}) > 1 for flow in sessions)
    assert {router_of(r, 4) for r in trace.requests} == {0, 1, 2, 3}
    assert {router_of(r, 1, pin_flows=True) for r in trace.requests} == {0}


def test_quick_run_with_flows_pinned(tmp_path: Path) -> None:
    """--pin-flows in a real run: recorded in the report and said in its header; every
    request decided once."""
    done, report = _quick(tmp_path, "grpc-chat", "sidecar", "--pin-flows", timeout=120)
    assert report["params"]["pin_flows"] is True
    assert "[--pin-flows: a flow's requests through one sidecar]" in done.stdout
    for run in report["paths"]["grpc-chat"].values():
        _check_run(run, report["trace"]["requests"])
        assert sum(run["organic_decisions"].values()) == report["trace"]["requests"]


@pytest.mark.parametrize("chat", [True, False])
def test_replay_with_flows_pinned_follows_every_turn(chat: bool) -> None:
    """--pin-flows: a flow's requests through one router, so session follow (contract 9h)
    keeps each turn where the previous one went (no turn moved) - a chat's, and a raw
    prompt's in its chat template (the trace's raw prompts are ChatML); spread at random
    over two routers, some are not followed and move; with follow off, pinned turns move."""
    trace = build_trace(TraceParams(seed=4, duration_s=16.0, tenants=6, templates=3))
    ring = replay_ring(4, 1)
    pinned = replay(trace, ring, 2, chat=chat, pin_flows=True)
    spread = replay(trace, ring, 2, chat=chat)
    assert pinned.moved == 0.0 < spread.moved
    unfollowed = replay(trace, ring, 2, chat=chat, pin_flows=True, factory=POLICIES["unfollowed"])
    assert unfollowed.moved > 0.0


def test_replay_measures_after_a_warm_up() -> None:
    """--measure-after: earlier requests are routed and cached but not counted, so the
    counted ones find what the warm-up left (a steady state); 0 counts every request."""
    trace = build_trace(TraceParams(seed=3, duration_s=16.0, tenants=6, templates=3))
    ring = replay_ring(4, 0)
    whole = replay(trace, ring, 2, chat=True)
    assert replay(trace, ring, 2, chat=True, measure_after=0.0) == whole
    late = replay(trace, ring, 2, chat=True, measure_after=8.0)
    assert late != whole and late.max_over_mean >= 1.0
    assert 0.5 < late.fraction <= 1.0 + 1e-9
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefix_sidecar_tools.bench.organic_replay",
            "--measure-after",
            "50",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "--measure-after must be" in done.stderr


def test_replay_against_a_report_uses_its_own_pods(organic_report: WriteReport) -> None:
    """`--against`: a report's organic runs replayed on the ring of the report's pods."""
    run = {"load": {"max_over_mean": 9.0}, "fraction": 0.5}
    path, pods = organic_report(run)
    lines = against_report(path)
    assert [line.split()[:2] for line in lines] == [
        ["grpc-chat", "sidecar"],
        ["grpc-chat", "sidecar_x2"],
        ["grpc-chat", "wide_x2"],
    ]
    trace = build_trace(TraceParams(seed=3, duration_s=8.0, tenants=6, templates=3))
    expected = replay(trace, _core.Ring(sorted(pods)), 1, chat=True)
    assert f"replay {expected.max_over_mean:.2f} measured 9.00" in lines[0]


def test_decision_lines_show_picks_and_failovers() -> None:
    """Each sidecar run's organic decisions, then how bounded load picked and what failed
    over (a failover moves a request to another pod too)."""
    run = {
        "organic_decisions": {"later_turn": 3, "start_stayed": 1},
        "picks": {"home": 3, "spill": 1},
        "failovers": {"timeout": 2},
    }
    report = {"paths": {"grpc-chat": {"sidecar": run, "window": {}}}}
    lines = _organic_decision_lines(report)
    assert lines[1:] == [
        "organic decisions (the sidecars' counts, whole run):",
        "  grpc-chat sidecar: later_turn 75.0 %, start_stayed 25.0 %",
        "                     picks: home 75.0 %, spill 25.0 %",
        "                     failovers: timeout 2",
    ]
