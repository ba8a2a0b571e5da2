"""`--measure`: hit rate and replicas from the real routing core, not from a guess.

The sidecar's own router (sidecar.routing.Router with policy prefix_affinity, the budgeted
home placement and the bounded-load pick of sidecar._core) routes a Poisson stream of the
scenario's prefix mix over the planned fleet, in memory: each request holds its pod's
in-flight count for its modelled duration, as the sidecar's counts do. A pod serves a
prefix from cache if the prefix is resident there: its home set is prewarmed, and a spill
to another pod makes the prefix resident there too (a whole miss), evicting that pod's least
recently used non-home prefix when its homed tokens would exceed the KV budget.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from dataclasses import dataclass

from sidecar.config import build_config
from sidecar.membership.pool import BackendPool
from sidecar.membership.sources import Member
from sidecar.prefixes import PrefixStore
from sidecar.routing.router import Router
from sidecar.tools.plan.scenario import Scenario, ScenarioError

BYTES_PER_TOKEN = 4  # the texts registered here are 4 bytes a token, as the emulator counts
MAX_PODS = 512
MAX_REQUESTS = 200_000
LOAD_FACTOR = 1.25


@dataclass(frozen=True)
class Measured:
    hit_rates: dict[str, float]  # per prefix: fraction of its requests served from cache
    token_hit_rate: float
    replicas: dict[str, int]  # home set size per prefix
    max_over_mean: float  # busiest pod's requests over the mean
    requests: int
    spills: int


def _text(name: str, tokens: int) -> str:
    head = f"[{name}] "
    return head + "r" * max(1, tokens * BYTES_PER_TOKEN - len(head))


def measure(
    scenario: Scenario,
    pods: int,
    replicas: dict[str, int],
    hold_s: float,
    *,
    requests: int | None = None,
    seed: int = 0,
) -> Measured:
    if not 1 <= pods <= MAX_PODS:
        raise ScenarioError(f"--measure routes over up to {MAX_PODS} pods; this plan needs {pods}")
    t, pod = scenario.traffic, scenario.pod
    rate = t.peak_rps
    in_flight = rate * hold_s
    count = requests or min(MAX_REQUESTS, max(20_000, math.ceil(3 * in_flight)))
    own = t.query_tokens + (t.output_tokens if pod.kv_counts_output else 0)
    reserve = math.ceil(LOAD_FACTOR * in_flight / pods * own)
    budget = max(1, pod.kv_tokens - reserve)
    urls = [f"http://plan-pod-{i}.invalid:8000" for i in range(pods)]
    pool = BackendPool(warm_before_serve=False)
    pool.set_members([Member(url, 1) for url in urls])
    for url in urls:
        pool.set_health(url, True)
    biggest = max(p.tokens for p in t.prefixes) * BYTES_PER_TOKEN + 64
    store = PrefixStore(max_prefixes=len(t.prefixes) + 1, max_bytes=biggest)
    entries = [
        store.register(p.name, _text(p.name, p.tokens), min(pods, replicas.get(p.name, 1)))[0]
        for p in t.prefixes
    ]
    config = build_config(
        overrides={
            "policy": "prefix_affinity",
            "home_kv_budget_tokens": budget,
            "home_balance_factor": 1.1,
            "load_factor": LOAD_FACTOR,
        }
    )
    router = Router.from_config(pool, store, config)
    homes = {e.name: set(router.home_set(e)) for e in entries}
    resident: dict[str, OrderedDict[str, int]] = {url: OrderedDict() for url in urls}
    for prefix, entry in zip(t.prefixes, entries, strict=True):
        for url in homes[entry.name]:
            resident[url][prefix.name] = prefix.tokens
    rng = random.Random(f"plan-measure-{seed}")
    shares = [p.share for p in t.prefixes]
    index = range(len(t.prefixes))
    ends: list[tuple[float, str]] = []
    now = 0.0
    warm_up = count // 3
    served = dict.fromkeys(urls, 0)
    hits = [0] * len(t.prefixes)
    seen = [0] * len(t.prefixes)
    spills = 0
    for n in range(count):
        now += rng.expovariate(rate)
        while ends and ends[0][0] <= now:
            pool.release(heapq.heappop(ends)[1])
        which = rng.choices(index, shares)[0]
        prefix = t.prefixes[which]
        backend = router.for_prefix(entries[which]).backend
        pool.acquire(backend)
        heapq.heappush(ends, (now + hold_s, backend))
        cached = resident[backend]
        hit = prefix.name in cached
        if hit:
            cached.move_to_end(prefix.name)
        else:
            cached[prefix.name] = prefix.tokens
            while sum(cached.values()) > budget and len(cached) > 1:
                victim = next(
                    (k for k in cached if backend not in homes[k] and k != prefix.name), None
                )
                if victim is None:
                    break
                del cached[victim]
        if n >= warm_up:
            served[backend] += 1
            seen[which] += 1
            hits[which] += hit
            spills += backend not in homes[prefix.name]
    rates = {p.name: hits[i] / seen[i] for i, p in enumerate(t.prefixes) if seen[i]}
    weight = sum(p.share * p.tokens for p in t.prefixes)
    token_rate = sum(p.share * p.tokens * rates.get(p.name, 1.0) for p in t.prefixes) / weight
    mean = sum(served.values()) / pods
    return Measured(
        hit_rates=rates,
        token_hit_rate=token_rate,
        replicas={e.name: len(homes[e.name]) for e in entries},
        max_over_mean=max(served.values()) / mean if mean else math.nan,
        requests=count - warm_up,
        spills=spills,
    )
