"""One pod's queue: M/G/c prefill behind a FIFO limit on running requests (docs/plan.md).

The model is the emulator's and vLLM's scheduler, reduced to what sets TTFT:
- arrivals are Poisson (M) at `rate` req/s per pod;
- a request first waits FIFO for one of `running_limit` running slots (vLLM's
  max_num_seqs, or fewer if the KV cache cannot hold that many requests' own blocks);
- then FIFO for one of `prefill_slots` prefill servers (c; 1 = the GPU computes one
  prefill at a time); its service time is general (G): overhead + uncached tokens /
  prefill_tps, a mixture of a warm time and the cold times of the prefixes it may miss;
- its first token comes out of the prefill (TTFT = both waits + the prefill), then it
  holds its running slot `decode_s` more seconds while it decodes.

With `running_limit` large this is exactly M/G/c; with c = 1, M/G/1. Percentiles come from
Lindley's recursion run on a fixed stream of random numbers (the same for every rate, so a
curve over rates is smooth and a bisection on it is stable); the queue is declared unstable,
not simulated, when a resource's utilisation reaches 1.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
import random
from dataclasses import dataclass

from prefix_sidecar_tools.percentile import percentile

DEFAULT_SAMPLES = 40_000
WARMUP_FRACTION = 0.1  # the first requests find an empty pod: left out of the percentiles


@dataclass(frozen=True)
class ServiceMix:
    """Prefill service times (s) and their probabilities."""

    times: tuple[float, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.times or len(self.times) != len(self.weights):
            raise ValueError("a service mix needs one weight per time")
        if any(t < 0 for t in self.times) or any(w < 0 for w in self.weights):
            raise ValueError("service times and weights must be >= 0")
        if not math.isclose(sum(self.weights), 1.0, rel_tol=1e-6):
            raise ValueError(f"service weights sum to {sum(self.weights)}, not 1")

    @property
    def mean(self) -> float:
        return sum(t * w for t, w in zip(self.times, self.weights, strict=True))

    def quantile(self, q: float) -> float:
        """The q-quantile (0..1) of the service time alone: the TTFT of an idle pod."""
        pairs = sorted(zip(self.times, self.weights, strict=True))
        total = 0.0
        for time_s, weight in pairs:
            total += weight
            if total >= q - 1e-12:
                return time_s
        return pairs[-1][0]


@dataclass(frozen=True)
class PodQueue:
    prefill_slots: int  # c
    running_limit: int  # FIFO admission limit (max running, or what KV can hold)
    decode_s: float  # seconds a request keeps its running slot after its first token
    overhead_s: float = 0.0  # added to every TTFT (network, router): outside the pod


@dataclass(frozen=True)
class QueueResult:
    rate: float
    prefill_utilisation: float  # rate x E[S] / c
    running_utilisation: float  # rate x E[hold] / running_limit (Little's law)
    stable: bool
    p50_s: float
    p99_s: float
    mean_s: float


@functools.lru_cache(maxsize=8)
def _draws(samples: int, seed: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Unit exponential gaps and uniforms, shared by every evaluation (common random numbers)."""
    rng = random.Random(f"plan-queue-{seed}")
    gaps = tuple(rng.expovariate(1.0) for _ in range(samples))
    picks = tuple(rng.random() for _ in range(samples))
    return gaps, picks


def _ttfts(queue: PodQueue, mix: ServiceMix, rate: float, samples: int, seed: int) -> list[float]:
    gaps, picks = _draws(samples, seed)
    cumulative = list(itertools.accumulate(mix.weights))
    cumulative[-1] = 1.0
    times = mix.times
    servers = [0.0] * queue.prefill_slots  # when each prefill server is next free (a heap)
    limited = queue.running_limit < samples
    slots = [0.0] * queue.running_limit if limited else []  # when each running slot frees
    decode_s = queue.decode_s
    scale = 1.0 / rate
    now = 0.0
    last_admit = 0.0
    out = []
    for gap, pick in zip(gaps, picks, strict=True):
        now += gap * scale
        admit = now
        if limited:
            free = heapq.heappop(slots)
            admit = max(now, free, last_admit)  # FIFO: nobody overtakes at the door
            last_admit = admit
        start = max(admit, servers[0])
        end = start + times[bisect.bisect_left(cumulative, pick)]
        heapq.heapreplace(servers, end)
        if limited:
            heapq.heappush(slots, end + decode_s)
        out.append(end - now)
    return out[int(samples * WARMUP_FRACTION) :]


def evaluate(
    queue: PodQueue,
    mix: ServiceMix,
    rate: float,
    *,
    samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
) -> QueueResult:
    """TTFT p50/p99/mean (s) of one pod at `rate` req/s."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    prefill_u = rate * mix.mean / queue.prefill_slots
    hold = mix.mean + queue.decode_s
    running_u = rate * hold / queue.running_limit
    if prefill_u >= 1.0 or running_u >= 1.0:
        return QueueResult(rate, prefill_u, running_u, False, math.inf, math.inf, math.inf)
    ttfts = _ttfts(queue, mix, rate, samples, seed)
    extra = queue.overhead_s
    return QueueResult(
        rate=rate,
        prefill_utilisation=prefill_u,
        running_utilisation=running_u,
        stable=True,
        p50_s=percentile(ttfts, 50) + extra,
        p99_s=percentile(ttfts, 99) + extra,
        mean_s=sum(ttfts) / len(ttfts) + extra,
    )


def stability_limit(queue: PodQueue, mix: ServiceMix) -> tuple[float, str]:
    """The rate at which a resource saturates, and which: "prefill" or "running"."""
    by_prefill = queue.prefill_slots / mix.mean if mix.mean > 0 else math.inf
    by_running = queue.running_limit / (mix.mean + queue.decode_s)
    return (by_prefill, "prefill") if by_prefill <= by_running else (by_running, "running")


def max_rate_at_slo(
    queue: PodQueue,
    mix: ServiceMix,
    slo_s: float,
    *,
    samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
    tolerance: float = 0.002,
) -> float:
    """The highest per-pod rate whose TTFT p99 is within `slo_s` (bisection); 0 if none is."""
    limit, _ = stability_limit(queue, mix)
    idle_p99 = mix.quantile(0.99) + queue.overhead_s
    if idle_p99 > slo_s:
        return 0.0
    low, high = 0.0, limit
    while high - low > tolerance * high:
        middle = (low + high) / 2
        result = evaluate(queue, mix, middle, samples=samples, seed=seed)
        if result.stable and result.p99_s <= slo_s:
            low = middle
        else:
            high = middle
    return low
