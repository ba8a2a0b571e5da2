"""The TTFT queue model of bench organic's pods (prefix_sidecar_tools/bench/organic_ttft.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prefix_sidecar import _core
from prefix_sidecar_tools.bench import organic_ttft as model
from prefix_sidecar_tools.bench.organic_oracle import oracle
from prefix_sidecar_tools.bench.organic_replay import ring_of
from prefix_sidecar_tools.bench.organic_trace import (
    Flow,
    OrganicRequest,
    OrganicTrace,
    TraceParams,
    build_trace,
)
from prefix_sidecar_tools.emulator.tokenizer import block_hashes, count_tokens

# conftest.organic_report: a run -> (the report's path, its pods)
WriteReport = Callable[[dict[str, Any]], tuple[str, list[str]]]


ROOT = Path(__file__).resolve().parents[3]
PODS = model.PodModel()
PROMPT = "<|im_start|>system\n" + "rules of the shop. " * 120  # ~2,300 bytes


def _one_shot(seq: int, flow: int, at: float, prompt: str) -> Flow:
    request = OrganicRequest(seq, "tenant", 0, flow, 0, (("system", prompt),), prompt, 0.0, at)
    return Flow(flow, at, (request,))


def _trace(flows: list[Flow]) -> OrganicTrace:
    requests = sorted((r for f in flows for r in f.requests), key=lambda r: r.seq)
    return OrganicTrace(TraceParams(), flows, requests)


def _service(tokens: int, cached: int) -> float:
    return PODS.prefill_overhead_s + (tokens - cached) / PODS.prefill_tps


def test_one_pod_serves_prefills_first_come_first_served_and_caches_them() -> None:
    """Two requests at once on one pod: the second waits for the first's prefill, then
    computes only what the first did not leave in the cache (the oracle's hits)."""
    trace = _trace([_one_shot(0, 0, 0.0, PROMPT), _one_shot(1, 1, 0.0, PROMPT)])
    first, second = model.ttfts(trace, 1, lambda *_: 0, warmup_s=0.0)
    ceilings = oracle([PROMPT, PROMPT])
    tokens = count_tokens(PROMPT.encode())
    assert ceilings[1].cached_tokens > 0.9 * tokens
    assert first == pytest.approx(_service(tokens, 0))
    assert second == pytest.approx(first + _service(tokens, ceilings[1].cached_tokens))


def test_a_sessions_next_turn_leaves_after_the_answer_and_the_gap() -> None:
    """Closed loop: turn 2 is sent `gap_s` after turn 1's answer has streamed, so a prefill
    that arrives just before then is ahead of it in the queue."""
    turn1 = OrganicRequest(0, "session", 0, 0, 0, (("user", "hi"),), "hi " * 40, 0.0, 0.0)
    turn2 = OrganicRequest(2, "session", 0, 0, 1, (("user", "hi"),), "ho " * 40, 1.0, 1.5)
    sent = _service(count_tokens(turn1.prompt.encode()), 0) + PODS.answer_s + 1.0
    big = "x" * 8000
    trace = _trace([Flow(0, 0.0, (turn1, turn2)), _one_shot(1, 1, sent - 0.001, big)])
    times = model.ttfts(trace, 1, lambda *_: 0, warmup_s=0.0)
    assert len(times) == 3
    waited = _service(count_tokens(big.encode()), 0) - 0.001
    assert times[-1] == pytest.approx(waited + _service(count_tokens(turn2.prompt.encode()), 0))


def test_greedy_reads_caches_and_queues() -> None:
    """Perfect information: a repeat goes where its prefix is cached; a new prompt that
    arrives while that pod is busy goes to the idle one."""
    pods = model.Pods(2, PODS)
    data = PROMPT.encode()
    chain, tokens = block_hashes(data), count_tokens(data)
    request = _one_shot(0, 0, 0.0, PROMPT).requests[0]
    assert model.greedy(request, chain, tokens, 0.0, pods) == 0  # tie: the first pod
    pods.serve(0, 0.0, chain, tokens)
    later = pods.free_at[0] + 1.0
    assert model.greedy(request, chain, tokens, later, pods) == 0  # cached there
    assert pods.finish_at(1, later, chain, tokens) > pods.finish_at(0, later, chain, tokens)
    other = ("another prompt entirely. " * 90).encode()
    busy = model.greedy(request, block_hashes(other), count_tokens(other), 0.001, pods)
    assert busy == 1


def test_window_spills_under_bounded_load_like_the_sidecar() -> None:
    """The window's key owner until it holds the cap floor (8) in flight, then the spill."""
    ring = _core.Ring(["http://127.0.0.1:40001", "http://127.0.0.1:40002"])
    choose = model.window(ring, chat=False)
    pods = model.Pods(2, PODS)
    data = PROMPT.encode()
    chain, tokens = block_hashes(data), count_tokens(data)
    request = _one_shot(0, 0, 0.0, PROMPT).requests[0]
    home = choose(request, chain, tokens, 0.0, pods)
    for _ in range(model.LOAD_CAP_FLOOR):
        assert choose(request, chain, tokens, 0.0, pods) == home
        pods.serve(home, 0.0, chain, tokens)
    assert list(pods.loads(0.0)) == [8 if m == home else 0 for m in range(2)]
    assert choose(request, chain, tokens, 0.0, pods) == 1 - home
    assert list(pods.loads(1e6)) == [0, 0]  # every answer has streamed


def test_no_router_beats_the_floor_on_a_real_trace() -> None:
    """Each request's modelled TTFT is at least its floor (ceiling hits, no wait), so every
    router's p99 is; the routers differ."""
    trace = build_trace(TraceParams(seed=2, duration_s=14.0, tenants=6, templates=3))
    ring = ring_of(3, 0)
    floor = model.p99(model.floor_ttfts(trace, warmup_s=0.0))
    p99s = {
        name: model.p99(model.ttfts(trace, 3, choose, warmup_s=0.0))
        for name, choose in (
            ("window", model.window(ring, chat=True)),
            ("sidecar_x2", model.sidecars(ring, chat=True, count=2)),
            ("greedy", model.greedy),
        )
    }
    assert all(value >= floor - 1e-9 for value in p99s.values()), (floor, p99s)
    assert len(set(p99s.values())) > 1


def test_against_a_report_models_its_runs_on_its_pods(organic_report: WriteReport) -> None:
    """`--against`: the window's and the sidecars' runs of a report (gRPC paths), modelled
    on the report's own pods, beside the p99 each measured."""
    path, pods = organic_report({"ttft_ms": {"p99": 1234.0}})
    lines = model.against_report(path)
    assert [line.split()[:2] for line in lines] == [
        ["grpc-chat", "window"],
        ["grpc-chat", "sidecar"],
        ["grpc-chat", "sidecar_x2"],
    ]
    trace = build_trace(TraceParams(seed=3, duration_s=8.0, tenants=6, templates=3))
    ring = _core.Ring(sorted(pods))
    expected = model.p99(model.ttfts(trace, 3, model.window(ring, chat=True), warmup_s=2.0))
    assert f"model {1000 * expected:5.0f} ms" in lines[0]
    assert lines[0].endswith("measured  1234 ms")


def test_the_command_prints_every_router_and_refuses_a_bad_path() -> None:
    command = [sys.executable, "-m", "prefix_sidecar_tools.bench.organic_ttft"]
    small = ["--seeds", "1", "--rings", "1", "--sidecars", "1", "--duration", "12"]
    done = subprocess.run(
        [*command, *small, "--paths", "chat"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    names = [line.split()[0] for line in done.stdout.splitlines()[1:]]
    assert names == ["floor", "window", "greedy", "sidecar_x1"]
    assert "window / it: median 1.00, >= 1.5 in 0/1" in done.stdout
    bad = subprocess.run(
        [*command, *small, "--paths", "grpc"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert bad.returncode == 2 and "neither raw nor chat" in bad.stderr
