"""The request trace: mega-sale prefixes with Zipf popularity, thin inputs, Poisson arrivals.

One trace is generated once per run and replayed unchanged for every routing policy, so
policies differ only in where they send each request. Times are MODELLED seconds (the
emulator's clock); the driver divides them by the fleet's time scale.

Replica sizing follows docs/mission.md's correction: a hot prefix must live on several pods. A
pod taking a prefix's share must stay under the bounded-load cap (load_factor x the mean
per-pod rate) after the traffic it gets anyway from other prefixes, and under a target
utilisation of its warm-request capacity; the replica count is the smallest that does both.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from prefix_sidecar_tools.emulator import EmulatorConfig
from prefix_sidecar_tools.workload.texts import (
    CATEGORIES,
    merchant_query,
    rules_text,
    script_text,
    tokens_of,
)


@dataclass(frozen=True)
class PrefixDef:
    name: str
    text: str
    weight: float  # share of requests, sums to 1 over a workload
    replicas: int = 0  # 0: sidecar default

    @property
    def tokens(self) -> int:
        return tokens_of(self.text)


@dataclass(frozen=True)
class Arrival:
    seq: int
    at: float  # modelled seconds since the start of the trace
    prefix: int  # index into the workload's prefixes
    input: str


def zipf_weights(count: int, exponent: float) -> list[float]:
    """Normalised Zipf popularity: rank r gets 1 / r**exponent."""
    if count < 1:
        raise ValueError("need at least one prefix")
    if exponent < 0:
        raise ValueError(f"the Zipf exponent must be >= 0, got {exponent}")
    raw = [1.0 / (rank**exponent) for rank in range(1, count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def mega_sale_prefixes(
    count: int,
    *,
    hot_tokens: int = 60_000,
    tail_tokens: int = 12_000,
    zipf: float = 1.2,
    seed: int = 0,
) -> list[PrefixDef]:
    """Prefix 0 is the compliance rules (hot), 1 the live-stream script, the rest category
    annexes; popularity is Zipf by that rank."""
    weights = zipf_weights(count, zipf)
    prefixes = [PrefixDef("compliance-rules", rules_text(hot_tokens, seed), weights[0])]
    if count > 1:
        prefixes.append(PrefixDef("live-stream-script", script_text(tail_tokens, seed), weights[1]))
    for rank in range(2, count):
        category = CATEGORIES[(rank - 2) % len(CATEGORIES)]
        name = f"annex-{category.replace(' ', '-')}-{rank}"
        text = rules_text(tail_tokens, seed, edition=f"{category} category annex {rank}")
        prefixes.append(PrefixDef(name, text, weights[rank]))
    return prefixes


def poisson_trace(
    prefixes: list[PrefixDef],
    requests: int,
    rate: float,
    *,
    input_tokens: int = 200,
    seed: int = 0,
) -> list[Arrival]:
    """`requests` arrivals at `rate` per modelled second (exponential gaps), prefixes drawn
    by weight, each with its own merchant query."""
    if requests < 1 or rate <= 0:
        raise ValueError(f"need requests >= 1 and rate > 0, got {requests} and {rate}")
    rng = random.Random(f"trace-{seed}")
    weights = [p.weight for p in prefixes]
    indices = range(len(prefixes))
    at = 0.0
    trace = []
    for seq in range(requests):
        at += rng.expovariate(rate)
        prefix = rng.choices(indices, weights)[0]
        trace.append(Arrival(seq, at, prefix, merchant_query(rng, input_tokens)))
    return trace


def warm_capacity(prefill_tps: float, prefill_overhead_s: float, input_tokens: int) -> float:
    """Warm requests per modelled second one pod can prefill (one prefill at a time)."""
    return 1.0 / (prefill_overhead_s + input_tokens / prefill_tps)


def size_replicas(
    prefixes: list[PrefixDef],
    rate: float,
    pods: int,
    capacity: float,
    *,
    load_factor: float = 1.25,
    utilisation: float = 0.8,
) -> list[int]:
    """Replicas per prefix from the arrival rate and the per-pod warm capacity.

    Prefix p arrives at r_p = weight_p x rate. Each of its R pods takes r_p / R and also
    its share of the rest, (rate - r_p) / pods; that must stay under the bounded-load cap
    load_factor x rate / pods, and r_p / R under utilisation x capacity.
    """
    mean = rate / pods
    result = []
    for prefix in prefixes:
        own = prefix.weight * rate
        headroom = load_factor * mean - (rate - own) / pods
        by_balance = math.ceil(own / headroom) if headroom > 0 else pods
        by_capacity = math.ceil(own / (utilisation * capacity))
        result.append(min(pods, max(1, by_balance, by_capacity)))
    return result


ANSWER_TOKENS = 500  # docs/mission.md's T_out: streams last as long as a 500-token answer
INPUT_TOKENS = 200  # docs/mission.md's T_user


def home_kv_budget(
    pod: EmulatorConfig, rate: float, pods: int, max_tokens: int, *, load_factor: float = 1.25
) -> int:
    """The sidecar's `home_kv_budget_tokens` for this workload: the pod's KV minus what its
    in-flight requests hold (routing contract section 6).

    A stream lasts about max_tokens / decode_tps modelled seconds; a pod carries up to
    load_factor x its mean share of them at once, each holding its own input + output tokens
    in whole 16-token blocks. Prefix tokens beyond the rest make requests wait for KV.
    """
    stream_s = max_tokens / pod.decode_tps
    in_flight = load_factor * rate * stream_s / pods
    own_tokens = -(-(INPUT_TOKENS + max_tokens) // 16) * 16
    return max(1, pod.kv_tokens - math.ceil(in_flight * own_tokens))


def mega_sale_pod(time_scale: float, kv_tokens: int, max_tokens: int) -> EmulatorConfig:
    """The emulated pod the demo and the fleet bench share: answers cut to `max_tokens`
    but streamed at the pace of a 500-token answer, so as many streams stay in flight as in
    docs/mission.md without relaying 500 chunks per request."""
    return EmulatorConfig(
        time_scale=time_scale,
        kv_tokens=kv_tokens,
        decode_tps=35.0 * max_tokens / ANSWER_TOKENS,
        max_running=256,
    )


@dataclass(frozen=True)
class FleetSizing:
    """What a run on emulated pods derives from the pod and the traffic before it starts."""

    capacity: float  # warm requests per modelled second one pod prefills
    replicas: list[int]  # per prefix
    budget: int  # the sidecar's home_kv_budget_tokens


def size_fleet(
    pod: EmulatorConfig, prefixes: list[PrefixDef], rate: float, pods: int, max_tokens: int
) -> FleetSizing:
    """The warm capacity, the replicas and the KV budget for `rate` requests per modelled
    second over `pods` pods like `pod`: the sizing the fleet bench and the demo share."""
    capacity = warm_capacity(pod.prefill_tps, pod.prefill_overhead_s, INPUT_TOKENS)
    return FleetSizing(
        capacity=capacity,
        replicas=size_replicas(prefixes, rate, pods, capacity),
        budget=home_kv_budget(pod, rate, pods, max_tokens),
    )
