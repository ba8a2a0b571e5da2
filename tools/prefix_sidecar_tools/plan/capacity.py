"""The fleet plan of one column (no cache, round-robin with cache, or the sidecar).

Per pod: the service mix (prefill times of warm and missed requests), the running limit
(max_running, or fewer if KV cannot hold more requests' own blocks), then the highest
per-pod rate whose TTFT p99 meets the SLO (queueing.max_rate_at_slo). The fleet: pods =
ceil(peak / that rate); TTFT at the planned load; replicas per prefix; yuan per day.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefix_sidecar_tools.cost import CostParams, daily_cost
from prefix_sidecar_tools.plan import queueing
from prefix_sidecar_tools.plan.scenario import Prefix, Scenario, ScenarioError

NO_CACHE = "no cache"
EVERYWHERE = "round-robin"  # caching on, every prefix on every pod (a baseline router)
SIDECAR = "sidecar"
BINDING_SHARE = 0.9  # a resource binds when the SLO rate is within 10 % of its limit


class Unreachable(ScenarioError):
    """No pod count meets the SLO."""


@dataclass(frozen=True)
class Column:
    kind: str
    slo_ms: float
    hit_rate: float  # prefix-token hit rate
    rate_per_pod: float  # max req/s per pod at the SLO
    pods: int
    gpus: int
    binding: str  # prefill, decode, KV or SLO
    limits: dict[str, float]  # req/s per pod at which each resource saturates
    p50_ms: float  # at the planned load (peak / pods)
    p99_ms: float
    load_per_pod: float
    replicas: dict[str, int]
    yuan_per_day: float
    running_limit: int
    notes: list[str] = field(default_factory=list)

    @property
    def qps_per_gpu(self) -> float:
        return self.rate_per_pod * self.pods / self.gpus if self.gpus else 0.0


def service_mix(scenario: Scenario, kind: str) -> queueing.ServiceMix:
    """Prefill seconds per request: overhead + uncached tokens / prefill_tps, by prefix and
    hit or miss (routing.miss: whole = a miss recomputes the prefix, with probability 1 -
    hit; partial = every request recomputes (1 - hit) of it)."""
    pod, t = scenario.pod, scenario.traffic
    base = pod.prefill_overhead_ms / 1e3
    tps = pod.prefill_tps
    times: list[float] = []
    weights: list[float] = []

    def add(seconds: float, weight: float) -> None:
        if weight > 0:
            times.append(seconds)
            weights.append(weight)

    for p in t.prefixes:
        cold = base + (p.tokens + t.query_tokens) / tps
        if kind == NO_CACHE:
            add(cold, p.share)
            continue
        hit = scenario.hit_rate_of(p)
        warm = base + t.query_tokens / tps
        if scenario.routing.miss == "partial":
            add(base + (t.query_tokens + (1 - hit) * p.tokens) / tps, p.share)
        else:
            add(warm, p.share * hit)
            add(cold, p.share * (1 - hit))
    total = sum(weights)
    return queueing.ServiceMix(tuple(times), tuple(w / total for w in weights))


def idle_p99_ms(scenario: Scenario, kind: str) -> float:
    """The TTFT p99 of an idle pod: no fleet size does better."""
    mix = service_mix(scenario, kind)
    return (mix.quantile(0.99) + scenario.pod.overhead_ms / 1e3) * 1e3


def own_tokens(scenario: Scenario, kind: str) -> float:
    """KV tokens one running request holds beside the shared, resident prefixes."""
    t, pod = scenario.traffic, scenario.pod
    own = t.query_tokens + (t.output_tokens if pod.kv_counts_output else 0)
    if kind == NO_CACHE:  # nothing is shared: each request holds its whole prefix
        return own + scenario.mean_prefix_tokens()
    if scenario.routing.miss == "partial":  # the recomputed part is the request's own
        return own + sum(p.share * (1 - scenario.hit_rate_of(p)) * p.tokens for p in t.prefixes)
    return own


def resident_tokens(scenario: Scenario, kind: str, pods: int, replicas: dict[str, int]) -> float:
    """Prefix tokens a pod keeps resident: none without a cache, every prefix under
    round-robin, its share of the homed prefixes (at least the largest one) with the sidecar."""
    prefixes = scenario.traffic.prefixes
    if kind == NO_CACHE:
        return 0.0
    if kind == EVERYWHERE or pods <= 1:
        return float(sum(p.tokens for p in prefixes))
    homed = sum(p.tokens * min(pods, replicas.get(p.name, 1)) for p in prefixes) / pods
    return max(homed, max(p.tokens for p in prefixes))


def size_replicas(
    prefixes: Sequence[Prefix], peak: float, pods: int, rate: float
) -> dict[str, int]:
    """Pods each prefix must live on: its own traffic over one pod's rate at the SLO, and
    the bounded-load rule bench fleet sizes with (prefix_sidecar_tools.workload.trace)."""
    from prefix_sidecar_tools.workload.trace import PrefixDef
    from prefix_sidecar_tools.workload.trace import size_replicas as by_load

    defs = [PrefixDef(p.name, "", p.share) for p in prefixes]
    counts = by_load(defs, peak, pods, rate / 0.8)  # its utilisation cap 0.8 x (rate / 0.8)
    return {p.name: c for p, c in zip(prefixes, counts, strict=True)}


def plan_column(
    scenario: Scenario,
    kind: str,
    *,
    replicas: dict[str, int] | None = None,
    samples: int = queueing.DEFAULT_SAMPLES,
    pods: int | None = None,
) -> Column:
    """Size the fleet for one column; `pods` fixes the fleet instead (for a small check)."""
    t, pod = scenario.traffic, scenario.pod
    slo_ms = t.slo_ms if kind == SIDECAR or t.no_cache_slo_ms is None else t.no_cache_slo_ms
    mix = service_mix(scenario, kind)
    decode_s = max(0, t.output_tokens - 1) / pod.decode_tps
    hit = 0.0 if kind == NO_CACHE else scenario.token_hit_rate()
    guess_replicas = dict(replicas or {})
    fleet = pods or 1
    result: Column | None = None
    for _ in range(4):  # resident prefixes depend on the fleet, the fleet on them
        resident = resident_tokens(scenario, kind, fleet, guess_replicas)
        kv_slots = math.floor((pod.kv_tokens - resident) / own_tokens(scenario, kind))
        notes = []
        if kv_slots < 1:
            raise ScenarioError(
                f"{kind}: a pod's KV ({pod.kv_tokens:,} tokens) cannot hold its resident "
                f"prefixes ({resident:,.0f} tokens) plus one request: add KV or pods"
            )
        running = min(pod.max_running, kv_slots)
        queue = queueing.PodQueue(pod.prefill_slots, running, decode_s, pod.overhead_ms / 1e3)
        hold = mix.mean + decode_s
        limits = {
            "prefill": pod.prefill_slots / mix.mean if mix.mean else math.inf,
            "decode": pod.max_running / hold,
            "KV": kv_slots / hold,
        }
        rate = queueing.max_rate_at_slo(queue, mix, slo_ms / 1e3, samples=samples)
        if rate <= 0:
            idle = (mix.quantile(0.99) + queue.overhead_s) * 1e3
            raise Unreachable(
                f"{kind}: the TTFT p99 SLO of {slo_ms:,.0f} ms cannot be met at any pod count: "
                f"even an idle pod's p99 is {idle:,.0f} ms (overhead + uncached tokens / "
                f"prefill_tps for the slowest 1 % of requests), and more pods do not make one "
                f"prefill faster"
            )
        binding = _binding(queue, mix, rate, slo_ms, limits, kv_slots < pod.max_running, samples)
        need = math.ceil(t.peak_rps / rate - 1e-9)
        new_fleet = pods or max(1, need)
        sized = (
            {p.name: new_fleet for p in t.prefixes}
            if kind == EVERYWHERE
            else (
                replicas
                if replicas
                else size_replicas(t.prefixes, t.peak_rps, new_fleet, rate)
                if kind == SIDECAR
                else {}
            )
        )
        load = t.peak_rps / new_fleet
        at_load = queueing.evaluate(queue, mix, load, samples=samples)
        if not at_load.stable:
            notes.append(f"unstable at the offered {load:.2f} req/s per pod")
        cost = daily_cost(
            _cost_params(scenario), 0.0 if kind == NO_CACHE else min(1.0, max(0.0, hit))
        )
        result = Column(
            kind=kind,
            slo_ms=slo_ms,
            hit_rate=hit,
            rate_per_pod=rate,
            pods=new_fleet,
            gpus=new_fleet * pod.gpus,
            binding=binding,
            limits=limits,
            p50_ms=at_load.p50_s * 1e3,
            p99_ms=at_load.p99_s * 1e3,
            load_per_pod=load,
            replicas=sized,
            yuan_per_day=cost.raw if kind == NO_CACHE else cost.cached,
            running_limit=running,
            notes=notes,
        )
        if new_fleet == fleet and sized == guess_replicas:
            break
        fleet, guess_replicas = new_fleet, dict(sized)
    assert result is not None
    return result


def _binding(
    queue: queueing.PodQueue,
    mix: queueing.ServiceMix,
    rate: float,
    slo_ms: float,
    limits: dict[str, float],
    kv_limited: bool,
    samples: int,
) -> str:
    """What stops the rate at the SLO from being higher. The running limit (decode slots,
    or KV when it holds fewer requests) binds when lifting it raises that rate by over 10 %;
    otherwise prefill binds when the rate is within 10 % of prefill saturation, else the SLO
    itself (the prefill queue's wait)."""
    unlimited = dataclasses.replace(queue, running_limit=10**9)
    free = queueing.max_rate_at_slo(unlimited, mix, slo_ms / 1e3, samples=samples)
    if free > rate * (2 - BINDING_SHARE):
        return "KV" if kv_limited else "decode"
    return "prefill" if rate >= BINDING_SHARE * limits["prefill"] else "SLO"


def _cost_params(scenario: Scenario) -> CostParams:
    """docs/mission.md's price model (prefix_sidecar_tools.cost) on this traffic: it is linear in
    prefix tokens, so the mean prefix at the token-weighted hit rate is exact."""
    t = scenario.traffic
    return dataclasses.replace(
        scenario.prices,
        requests_per_day=t.requests_per_day,
        prefix_tokens=scenario.mean_prefix_tokens(),
        user_tokens=t.query_tokens,
        output_tokens=t.output_tokens,
    )
