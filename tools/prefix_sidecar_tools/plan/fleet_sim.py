"""The fleet model: the sidecar's own router feeding one prefill queue per pod.

Per pod the queue is queueing.py's (FIFO running slots, then c FIFO prefill slots), but
its arrivals are not assumed Poisson: each request is placed by the real router
(prefix_sidecar.routing.Router, the real policy and routing core, in memory) on the in-flight
counts it would see, and each pod's queue takes exactly the requests placed on it.
That matters both ways: round-robin deals a Poisson stream out in turn, so each pod sees
Erlang-N gaps, smoother than Poisson; the bounded-load pick sends a prefix to the least
loaded of its homes by in-flight streams, which lag the prefill queue by a whole decode
(seconds), so requests herd onto one pod. docs/plan.md shows both against bench fleet.

Hits: a prefix is served from cache where it is resident (prewarmed on its home set, then
wherever a request warmed it; a pod over its KV budget evicts its least recently used
non-home prefix), or, when the scenario gives a hit rate for the prefix, with that
probability.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from prefix_sidecar.config import build_config
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.membership.sources import Member
from prefix_sidecar.prefixes import PrefixEntry, PrefixStore
from prefix_sidecar.routing.policy import make_policy
from prefix_sidecar.routing.router import Router
from prefix_sidecar.routing.router_settings import settings as router_settings
from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.plan.scenario import Scenario, ScenarioError

BYTES_PER_TOKEN = 4  # the texts registered here are 4 bytes a token, as the emulator counts
MAX_PODS = 512
LOAD_FACTOR = 1.25
WARMUP_FRACTION = 1 / 3


@dataclass
class FleetRun:
    ttfts_s: list[float]  # measured part, in arrival order
    hit_rates: dict[str, float]  # per prefix: fraction of its requests served from cache
    token_hit_rate: float
    replicas: dict[str, int]  # home set size per prefix
    loads: list[int]  # requests per pod
    spills: int

    @property
    def max_over_mean(self) -> float:
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else math.nan

    def p(self, q: float) -> float:
        return percentile(self.ttfts_s, q)


def _text(name: str, tokens: int) -> str:
    head = f"[{name}] "
    return head + "r" * max(1, tokens * BYTES_PER_TOKEN - len(head))


def kv_budget(scenario: Scenario, pods: int, rate: float, hold_s: float) -> int:
    """The sidecar's home_kv_budget_tokens: KV minus what in-flight requests hold (the rule
    of prefix_sidecar_tools.workload.trace.home_kv_budget)."""
    t, pod = scenario.traffic, scenario.pod
    own = t.query_tokens + (t.output_tokens if pod.kv_counts_output else 0)
    own = -(-own // 16) * 16
    return max(1, pod.kv_tokens - math.ceil(LOAD_FACTOR * rate * hold_s / pods * own))


def build_router(
    scenario: Scenario,
    pods: int,
    replicas: dict[str, int],
    policy: str,
    budget: int,
    *,
    urls: list[str] | None = None,
    texts: list[str] | None = None,
) -> tuple[Router, BackendPool, list[str], list[PrefixEntry]]:
    """The sidecar's router over in-memory pods; `urls` and `texts` (the pods' and the
    prefixes' own) reproduce a real fleet's ring and home placement exactly."""
    if not 1 <= pods <= MAX_PODS:
        raise ScenarioError(
            f"the fleet model routes over up to {MAX_PODS} pods request by request; "
            f"this plan needs {pods}"
        )
    prefixes = scenario.traffic.prefixes
    urls = urls or [f"http://plan-pod-{i}.invalid:8000" for i in range(pods)]
    texts = texts or [_text(p.name, p.tokens) for p in prefixes]
    # Loads in requests: the model's requests are thin queries of warm prefixes, each the
    # same weight, so counting tokens would only scale every load and cap alike.
    pool = BackendPool(warm_before_serve=False, load_unit="requests")
    pool.set_members([Member(url, 1) for url in urls])
    for url in urls:
        pool.set_health(url, True)
    biggest = max(len(text.encode("utf-8")) for text in texts)
    store = PrefixStore(max_prefixes=len(prefixes) + 1, max_bytes=biggest)
    entries = [
        store.register(p.name, text, min(pods, replicas.get(p.name, 1)))[0]
        for p, text in zip(prefixes, texts, strict=True)
    ]
    fields: dict[str, object] = {"load_factor": LOAD_FACTOR, "load_unit": "requests"}
    if policy == "prefix_affinity":
        fields["home_kv_budget_tokens"] = budget
    config = build_config(overrides=fields)
    settings = router_settings(config)
    if policy == "prefix_affinity":
        settings["home_balance_factor"] = 1.1  # as bench fleet runs the sidecar
    router = Router(pool, store, make_policy(policy, config), **settings)
    return router, pool, urls, entries


def simulate(
    scenario: Scenario,
    pods: int,
    rate: float,
    replicas: dict[str, int],
    *,
    policy: str = "prefix_affinity",
    requests: int = 20_000,
    seed: int = 0,
    budget: int | None = None,
    urls: list[str] | None = None,
    texts: list[str] | None = None,
    hop_s: Sequence[float] = (),
    warm_up: int | None = None,
) -> FleetRun:
    """`requests` Poisson arrivals at `rate` req/s over `pods` pods, routed by `policy`.
    `hop_s`: measured delays outside the pods; each TTFT gets one, drawn at random (the
    hop and the pod's queue are independent), instead of the pod's constant overhead_ms."""
    t, pod = scenario.traffic, scenario.pod
    decode_s = max(0, t.output_tokens - 1) / pod.decode_tps
    base = pod.prefill_overhead_ms / 1e3
    if budget is None:
        budget = kv_budget(scenario, pods, rate, decode_s)
    router, pool, urls, entries = build_router(
        scenario, pods, replicas, policy, budget, urls=urls, texts=texts
    )
    index_of = {url: i for i, url in enumerate(urls)}
    homes = [set(router.home_set(e)) for e in entries]
    resident: list[OrderedDict[int, int]] = [OrderedDict() for _ in urls]
    for which, prefix in enumerate(t.prefixes):
        for url in homes[which]:
            resident[index_of[url]][which] = prefix.tokens
    servers = [[0.0] * pod.prefill_slots for _ in urls]  # per pod: when each slot frees
    running = min(pod.max_running, requests)
    slots = [[0.0] * running for _ in urls]  # per pod: when each running slot frees
    last_admit = [0.0] * pods
    rng = random.Random(f"plan-fleet-{seed}")
    hop_rng = random.Random(f"plan-hop-{seed}")
    shares = [p.share for p in t.prefixes]
    choices = range(len(t.prefixes))
    ends: list[tuple[float, str]] = []
    now = 0.0
    if warm_up is None:  # the first requests find empty queues: not the steady state
        warm_up = int(requests * WARMUP_FRACTION)
    loads = [0] * pods
    hits = [0] * len(t.prefixes)
    seen = [0] * len(t.prefixes)
    ttfts: list[float] = []
    spills = 0
    for n in range(requests):
        now += rng.expovariate(rate)
        while ends and ends[0][0] <= now:
            pool.release(heapq.heappop(ends)[1])
        which = rng.choices(choices, shares)[0]
        prefix = t.prefixes[which]
        backend = router.for_prefix(entries[which]).backend
        pool.acquire(backend)
        i = index_of[backend]
        given = prefix.hit_rate
        if given is not None:
            hit = rng.random() < given
        else:
            hit = which in resident[i]
            _touch(resident[i], which, prefix.tokens, budget, homes, backend)
        uncached = t.query_tokens + (0 if hit else prefix.tokens)
        free = heapq.heappop(slots[i])
        admit = max(now, free, last_admit[i])
        last_admit[i] = admit
        start = max(admit, servers[i][0])
        end = start + base + uncached / pod.prefill_tps
        heapq.heapreplace(servers[i], end)
        heapq.heappush(slots[i], end + decode_s)
        heapq.heappush(ends, (end + decode_s, backend))
        if n >= warm_up:
            extra = hop_rng.choice(hop_s) if hop_s else pod.overhead_ms / 1e3
            ttfts.append(end - now + extra)
            loads[i] += 1
            seen[which] += 1
            hits[which] += hit
            spills += backend not in homes[which]
    rates = {p.name: hits[w] / seen[w] for w, p in enumerate(t.prefixes) if seen[w]}
    weight = sum(p.share * p.tokens for p in t.prefixes)
    token_rate = sum(p.share * p.tokens * rates.get(p.name, 1.0) for p in t.prefixes) / weight
    return FleetRun(
        ttfts_s=ttfts,
        hit_rates=rates,
        token_hit_rate=token_rate,
        replicas={e.name: len(h) for e, h in zip(entries, homes, strict=True)},
        loads=loads,
        spills=spills,
    )


def _touch(
    cached: OrderedDict[int, int],
    which: int,
    tokens: int,
    budget: int,
    homes: list[set[str]],
    backend: str,
) -> None:
    """Mark a prefix used on a pod: resident now, most recently used; over the budget, the
    least recently used prefix the pod is not home to goes."""
    if which in cached:
        cached.move_to_end(which)
        return
    cached[which] = tokens
    while sum(cached.values()) > budget:
        victim = next((k for k in cached if k != which and backend not in homes[k]), None)
        if victim is None:
            return
        del cached[victim]


def max_rate_at_slo(
    scenario: Scenario,
    pods: int,
    replicas: dict[str, int],
    slo_s: float,
    *,
    policy: str = "prefix_affinity",
    requests: int = 20_000,
    upper: float,
    budget: int | None = None,
    urls: list[str] | None = None,
    texts: list[str] | None = None,
    hop_s: Sequence[float] = (),
    tolerance: float = 0.01,
) -> float:
    """The highest fleet rate whose TTFT p99 is within `slo_s` (bisection, up to `upper`)."""
    low, high = 0.0, upper
    while high - low > tolerance * high:
        middle = (low + high) / 2
        run = simulate(
            scenario,
            pods,
            middle,
            replicas,
            policy=policy,
            requests=requests,
            budget=budget,
            urls=urls,
            texts=texts,
            hop_s=hop_s,
        )
        if run.p(99) <= slo_s:
            low = middle
        else:
            high = middle
    return low
