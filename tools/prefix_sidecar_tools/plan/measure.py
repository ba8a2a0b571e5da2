"""`--measure`: hit rate, replicas and load split from the real routing core, not a guess.

The fleet model (fleet_sim.simulate: the sidecar's own Router, policy prefix_affinity, the
budgeted home placement and the bounded-load pick of prefix_sidecar._core) routes a Poisson stream
of the scenario's prefix mix over the planned fleet at the peak rate; a prefix is a hit
where it is resident (its home set, prewarmed, and wherever a spill warmed it).
"""

from __future__ import annotations

import dataclasses
import math

from prefix_sidecar_tools.plan.fleet_sim import FleetRun, simulate
from prefix_sidecar_tools.plan.scenario import Scenario

MAX_REQUESTS = 200_000


def measure(
    scenario: Scenario, pods: int, replicas: dict[str, int], *, requests: int | None = None
) -> FleetRun:
    t, pod = scenario.traffic, scenario.pod
    hold_s = max(0, t.output_tokens - 1) / pod.decode_tps
    in_flight = t.peak_rps * hold_s
    count = requests or min(MAX_REQUESTS, max(20_000, math.ceil(3 * in_flight)))
    # hits come from residency, not from a rate given beforehand
    prefixes = tuple(dataclasses.replace(p, hit_rate=None) for p in t.prefixes)
    free = dataclasses.replace(scenario, traffic=dataclasses.replace(t, prefixes=prefixes))
    return simulate(free, pods, t.peak_rps, replicas, requests=count)
