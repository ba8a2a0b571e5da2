"""The queue model against closed forms: Pollaczek-Khinchine's M/G/1 mean wait, Erlang's
M/M/c... (here M/D/c at c = 1 and a two-point M/G/1), and the running-slot limit."""

from __future__ import annotations

import pytest

from prefix_sidecar_tools.plan.queueing import (
    PodQueue,
    ServiceMix,
    evaluate,
    max_rate_at_slo,
    stability_limit,
)

UNLIMITED = 10**9


def pk_mean_wait(rate: float, mix: ServiceMix) -> float:
    """Pollaczek-Khinchine: E[W] = rate x E[S^2] / (2 (1 - rho))."""
    second = sum(w * t * t for t, w in zip(mix.times, mix.weights, strict=True))
    rho = rate * mix.mean
    return rate * second / (2 * (1 - rho))


@pytest.mark.parametrize(
    "mix",
    [ServiceMix((0.1,), (1.0,)), ServiceMix((0.02, 0.5), (0.9, 0.1))],
    ids=["M/D/1", "two-point M/G/1"],
)
@pytest.mark.parametrize("rho", [0.3, 0.7])
def test_mean_ttft_matches_pollaczek_khinchine(mix: ServiceMix, rho: float) -> None:
    rate = rho / mix.mean
    result = evaluate(PodQueue(1, UNLIMITED, 0.0), mix, rate, samples=200_000)
    expected = pk_mean_wait(rate, mix) + mix.mean
    assert result.mean_s == pytest.approx(expected, rel=0.05)


def test_idle_pod_ttft_is_the_service_time() -> None:
    mix = ServiceMix((0.2,), (1.0,))
    result = evaluate(PodQueue(1, UNLIMITED, 0.0, overhead_s=0.01), mix, 0.01)
    assert result.p50_s == pytest.approx(0.21)
    assert result.p99_s == pytest.approx(0.21, rel=0.05)


def test_saturation_is_unstable_not_simulated() -> None:
    mix = ServiceMix((0.1,), (1.0,))
    assert not evaluate(PodQueue(1, UNLIMITED, 0.0), mix, 10.0).stable
    # 4 running slots held 1 s each: 4 req/s saturate them, whatever the prefill does
    queue = PodQueue(1, 4, 0.9)
    assert stability_limit(queue, mix) == (pytest.approx(4.0), "running")
    assert not evaluate(queue, mix, 4.0).stable
    assert max_rate_at_slo(queue, mix, 5.0) < 4.0


def test_more_prefill_slots_carry_more_at_the_same_slo() -> None:
    mix = ServiceMix((0.5,), (1.0,))
    one = max_rate_at_slo(PodQueue(1, UNLIMITED, 0.0), mix, 1.0)
    four = max_rate_at_slo(PodQueue(4, UNLIMITED, 0.0), mix, 1.0)
    assert 0 < one < 2.0  # below 1 / 0.5 s
    assert four > 3.5 * one
    # an SLO below the service time: nothing
    assert max_rate_at_slo(PodQueue(1, UNLIMITED, 0.0), mix, 0.4) == 0.0
