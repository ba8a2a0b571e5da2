"""An offline replay of `bench organic`'s trace: organic routing's hit rate and balance in
seconds, deterministic, no pods, no sockets.

Each of K routers (`OrganicRouter`, one per sidecar, as `bench organic` spreads requests:
at random, seeded by the sequence number) decides every request of the seeded trace in
nominal order; each pod is the emulator's own PrefixCache (LRU, --kv-tokens). No
concurrency: a request is allocated and released at once, and there is no bounded-load
pick (no request is ever in flight beside another). It measures what placement decides:
hit rate as a fraction of the oracle ceiling (whole run and per class), max/mean requests
per pod, and session turns moved. Rings are built from seeded random 127.0.0.1 ports, as
the bench's pods get. The real bench (`prefix-sidecar bench organic`) is the judge; this is
the quick filter for ideas (docs/organic-routing.md, "Limits").

    python -m prefix_sidecar_tools.bench.organic_replay --sidecars 1,4 --rings 12 --seeds 0,1,2
    python -m prefix_sidecar_tools.bench.organic_replay --against organic.json   (a real run's ring)
    python -m prefix_sidecar_tools.bench.organic_replay --duration 135 --measure-after 45
        (a steady state: flows start for 135 modelled seconds, the first 45 are routed and
        cached but not counted)
    python -m prefix_sidecar_tools.bench.organic_replay --pin-flows
        (a flow's requests through one sidecar, as when each caller has its own)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from prefix_sidecar import _core
from prefix_sidecar.routing.anchors import AnchorTable
from prefix_sidecar.routing.chat_templates import turn_marks
from prefix_sidecar.routing.organic import HEAD_BYTES, OrganicKeys, OrganicRouter
from prefix_sidecar_tools.bench.argtypes import (
    non_negative,
    positive_float,
    positive_int,
    whole_numbers,
)
from prefix_sidecar_tools.bench.organic_oracle import oracle
from prefix_sidecar_tools.bench.organic_trace import (
    CLASSES,
    OrganicRequest,
    OrganicTrace,
    TraceParams,
    build_trace,
    router_of,
)
from prefix_sidecar_tools.emulator.config import BLOCK_SIZE
from prefix_sidecar_tools.emulator.prefix_cache import PrefixCache
from prefix_sidecar_tools.emulator.tokenizer import block_hashes, count_tokens

RouterFactory = Callable[[], OrganicRouter]


@dataclass(frozen=True)
class ReplayResult:
    fraction: float  # hit rate / the oracle's
    classes: dict[str, float]  # per class, fraction of its own ceiling
    max_over_mean: float  # requests per pod
    moved: float  # session turns on another pod than the turn before


def ring_of(pods: int, seed: int) -> _core.HashTable:
    rng = random.Random(f"organic-replay-ring-{seed}")
    ports = rng.sample(range(20_000, 60_000), pods)
    return _core.Ring([f"http://127.0.0.1:{port}" for port in ports])


def organic_keys(router: OrganicRouter, request: OrganicRequest, chat: bool) -> OrganicKeys:
    """The keys the sidecar's Chat (`chat`) or Complete RPC gives `request`."""
    if chat:
        return router.for_chat(list(request.messages))
    head = request.prompt[:HEAD_BYTES].encode("utf-8")[:HEAD_BYTES]
    keys = router.for_prompt(head, turn_marks(request.prompt))  # as Router.for_prompt
    assert keys is not None, "the trace's prompts are longer than one block"
    return keys


def route(router: OrganicRouter, ring: _core.HashTable, request: OrganicRequest, chat: bool) -> int:
    """The member `router` sends `request` to, before the bounded-load pick; counted as sent."""
    keys = organic_keys(router, request, chat)
    member = router.homes(ring, keys)
    router.sent(ring, ring.members[member], keys)
    return member


def replay(
    trace: OrganicTrace,
    ring: _core.HashTable,
    sidecars: int,
    chat: bool,
    *,
    kv_tokens: int = 12_000,
    factory: RouterFactory = lambda: OrganicRouter(AnchorTable()),
    ceilings: Sequence[int] | None = None,
    measure_after: float = 0.0,
    pin_flows: bool = False,
) -> ReplayResult:
    """Route every request of `trace` on `ring` through `sidecars` routers; the pods' caches
    answer as the emulator's would with nothing in flight. Requests due before
    `measure_after` modelled seconds are routed and cached but not counted (a warm-up: the
    ceiling still counts what they left in its cache). Requests are spread over the routers
    as bench organic spreads them, or with `pin_flows` a flow's requests to one router."""
    routers = [factory() for _ in range(sidecars)]
    caches = [PrefixCache(max(1, kv_tokens // BLOCK_SIZE)) for _ in ring.members]
    if ceilings is None:
        ceilings = [c.cached_tokens for c in oracle([r.prompt for r in trace.requests])]
    counted = [0] * len(ring.members)
    hit: dict[str, int] = dict.fromkeys(CLASSES, 0)
    best: dict[str, int] = dict.fromkeys(CLASSES, 0)
    pod_of: dict[int, int] = {}
    moved = followed = 0
    for request in trace.requests:
        member = route(routers[router_of(request, sidecars, pin_flows)], ring, request, chat)
        data = request.prompt.encode("utf-8")
        chain = block_hashes(data)
        cache = caches[member]
        hits = cache.hit_blocks(chain, count_tokens(data)) * BLOCK_SIZE
        cache.allocate(chain)
        cache.release(chain)
        previous = pod_of.get(request.flow)
        pod_of[request.flow] = member
        if request.nominal_at < measure_after:
            continue
        counted[member] += 1
        hit[request.kind] += hits
        best[request.kind] += ceilings[request.seq]
        if request.turn:
            followed += 1
            moved += previous != member
    total_best = sum(best.values())
    return ReplayResult(
        fraction=sum(hit.values()) / total_best if total_best else 1.0,
        classes={k: hit[k] / best[k] if best[k] else 1.0 for k in CLASSES},
        max_over_mean=max(counted) / statistics.fmean(counted) if any(counted) else 1.0,
        moved=moved / followed if followed else 0.0,
    )


def sweep(
    seeds: Sequence[int],
    rings: int,
    sidecars: int,
    chat: bool,
    pods: int = 4,
    factory: RouterFactory = lambda: OrganicRouter(AnchorTable()),
    duration: float = 45.0,
    measure_after: float = 0.0,
    pin_flows: bool = False,
    **trace_params: float,
) -> list[ReplayResult]:
    results = []
    for seed in seeds:
        trace = build_trace(TraceParams(seed=seed, duration_s=duration, **trace_params))  # type: ignore[arg-type]
        ceilings = [c.cached_tokens for c in oracle([r.prompt for r in trace.requests])]
        for ring_seed in range(rings):
            results.append(
                replay(
                    trace,
                    ring_of(pods, ring_seed),
                    sidecars,
                    chat,
                    factory=factory,
                    ceilings=ceilings,
                    measure_after=measure_after,
                    pin_flows=pin_flows,
                )
            )
    return results


def describe(results: Sequence[ReplayResult]) -> str:
    mm = [r.max_over_mean for r in results]
    fr = [r.fraction for r in results]
    worst_class = [min(r.classes.values()) for r in results]
    return (
        f"max/mean mean {statistics.fmean(mm):.3f} (<=1.25 in {sum(m <= 1.25 for m in mm)}"
        f"/{len(mm)})  hit {statistics.fmean(fr):.3f} (>=0.97 in "
        f"{sum(f >= 0.97 for f in fr)}/{len(fr)}, min {min(fr):.3f})  classes>=0.95 in "
        f"{sum(w >= 0.95 for w in worst_class)}/{len(fr)} (lowest "
        f"{statistics.fmean(worst_class):.3f})  moved "
        f"{statistics.fmean(r.moved for r in results):.3f}"
    )


# bench organic's organic policies, as routers (the bench's settings for each)
POLICIES: dict[str, RouterFactory] = {
    "sidecar": lambda: OrganicRouter(AnchorTable()),
    "wide": lambda: OrganicRouter(AnchorTable(), 3.0, session_spread=3.0),
    "hashed": lambda: OrganicRouter(AnchorTable(), balance_starts=False),
    "unfollowed": lambda: OrganicRouter(AnchorTable(), follow_sessions=False),
}


@dataclass(frozen=True)
class ReportRun:
    """One run of a `bench organic --json` report, on the ring of its own pods."""

    path: str  # the bench path, e.g. grpc-chat
    name: str  # as reported, e.g. sidecar_x4
    policy: str  # the name without its _xK
    sidecars: int  # K
    run: dict[str, Any]  # what the report says of it
    ring: _core.HashTable  # its pods' URLs, as the sidecars' pool orders them


def read_report(path: str, policies: Collection[str]) -> tuple[dict[str, Any], list[ReportRun]]:
    """A report's params and its runs of `policies` on the gRPC paths (an HTTP path routes
    the same bodies alike)."""
    with open(path, encoding="utf-8") as source:
        report = json.load(source)
    runs = []
    for bench_path, named in report["paths"].items():
        if bench_path.startswith("http"):
            continue
        for name, run in named.items():
            policy, _, count = name.partition("_x")
            if policy in policies:
                ring = _core.Ring(sorted(run["load"]["per_pod"]))
                runs.append(ReportRun(bench_path, name, policy, int(count or 1), run, ring))
    return report["params"], runs


def against_report(path: str) -> list[str]:
    """Replay a `bench organic --json` report's organic runs on the ring of its own pods:
    replay and measured side by side."""
    params, runs = read_report(path, POLICIES)
    trace = build_trace(TraceParams.of_settings(params))
    ceilings = [c.cached_tokens for c in oracle([r.prompt for r in trace.requests])]
    lines = []
    for one in runs:
        result = replay(
            trace,
            one.ring,
            one.sidecars,
            one.path.endswith("chat"),
            kv_tokens=params["kv_tokens"],
            factory=POLICIES[one.policy],
            ceilings=ceilings,
            measure_after=params.get("measure_after", 0.0),
            pin_flows=params.get("pin_flows", False),
        )
        lines.append(
            f"{one.path:<14}{one.name:<12} max/mean replay {result.max_over_mean:.2f} "
            f"measured {one.run['load']['max_over_mean']:.2f}   hit /ceil replay "
            f"{result.fraction:.3f} measured {one.run['fraction']:.3f}"
        )
    return lines


def sweep_parser(doc: str, *, seeds: str, rings: int, against: str) -> argparse.ArgumentParser:
    """The options of every offline model of bench organic's trace (this replay and the
    TTFT model): which trace seeds, how many rings of pod ports per seed, K sidecars, the
    pods, the modelled seconds flows start in, or a bench organic report to read instead."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add = parser.add_argument
    add("--seeds", type=whole_numbers, default=seeds, help=f"comma-separated ({seeds})")
    add("--rings", type=positive_int, default=rings, help=f"rings per seed ({rings})")
    add("--sidecars", type=whole_numbers, default="1,4", help="sidecars K (1,4)")
    add("--pods", type=positive_int, default=4)
    add(
        "--duration",
        type=positive_float,
        default=45.0,
        help="modelled seconds flows start in (45, as bench organic)",
    )
    add("--against", metavar="REPORT.json", help=against)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = sweep_parser(
        __doc__,
        seeds="0,1,2",
        rings=12,
        against="replay a bench organic --json report's organic runs on its own pods instead",
    )
    parser.add_argument(
        "--measure-after",
        type=non_negative,
        default=0.0,
        help="modelled seconds routed but not counted: a steady state's warm-up (0)",
    )
    parser.add_argument(
        "--pin-flows",
        action="store_true",
        help="every request of a flow through one sidecar (default: each request to a "
        "random one, as bench organic sends them)",
    )
    args = parser.parse_args(argv)
    if args.against:
        print("\n".join(against_report(args.against)))
        return 0
    if args.measure_after >= args.duration:
        parser.error("--measure-after must be < --duration")
    for sidecars in args.sidecars:
        for chat in (False, True):
            results = sweep(
                args.seeds,
                args.rings,
                sidecars,
                chat,
                args.pods,
                duration=args.duration,
                measure_after=args.measure_after,
                pin_flows=args.pin_flows,
            )
            print(f"K={sidecars} {'chat' if chat else 'raw '}: {describe(results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
