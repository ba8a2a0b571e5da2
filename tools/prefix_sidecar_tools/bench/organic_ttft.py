"""What bounds `bench organic`'s TTFT p99: the trace through a queue model of its pods.

The p99 target of issue 14 compares a router with the 4,096-byte window. How much better
than the window can any router be on this trace? This replays the trace through a model of
the emulator's pods - each pod one FIFO prefill queue (`prefill_slots` 1: the GPU computes
one prefill at a time) in front of its own LRU prefix cache (the emulator's PrefixCache) -
and times every request: its wait, then `prefill_overhead_s + uncached tokens / prefill_tps`.
Flows run closed loop as the bench sends them: a session's next turn leaves `gap_s` after
the previous answer has streamed.

Routers, each on the same trace and ring:
- `window`: v1, the ring owner of the first 4,096 bytes (a chat: of its first message);
- `sidecar_xK`: K organic routers (the sidecar's own `OrganicRouter`), requests spread over
  them as `bench organic` spreads them;
- `greedy`: a router with perfect information - it reads every pod's cache and queue at the
  instant a request arrives and sends the request where its prefill ends first. No real
  router knows this much; it shows what knowing it would buy;
- `floor`: every request at its oracle-ceiling hits, never waiting (bench organic's floor).

The window and the sidecars pick under bounded load as the sidecar does (load factor 1.25,
cap floor 8) on every request in flight on a pod, as the sidecars' fleet view counts (without
its polling lag). `--against` checks the model on a
real run: its p99 beside the bench's, on the run's own pods.

    python -m prefix_sidecar_tools.bench.organic_ttft            (6 seeds x 8 rings, both paths)
    python -m prefix_sidecar_tools.bench.organic_ttft --load 2   (the trace's rates doubled)
    python -m prefix_sidecar_tools.bench.organic_ttft --against organic.json
"""

from __future__ import annotations

import array
import heapq
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from prefix_sidecar import _core
from prefix_sidecar.routing.anchors import AnchorTable
from prefix_sidecar.routing.organic import OrganicRouter
from prefix_sidecar_tools.bench.argtypes import positive_float
from prefix_sidecar_tools.bench.organic_oracle import oracle
from prefix_sidecar_tools.bench.organic_replay import (
    organic_keys,
    read_report,
    ring_of,
    sweep_parser,
)
from prefix_sidecar_tools.bench.organic_trace import (
    OrganicRequest,
    OrganicTrace,
    TraceParams,
    build_trace,
    router_of,
)
from prefix_sidecar_tools.emulator.config import BLOCK_SIZE, EmulatorConfig
from prefix_sidecar_tools.emulator.prefix_cache import PrefixCache
from prefix_sidecar_tools.emulator.tokenizer import block_hashes, count_tokens

WINDOW_BYTES = 4096  # v1's route_window_bytes
# The sidecar's defaults: load_factor, and the cap floor of organic and window picks alike
# (organic_load_cap_floor = load_cap_floor = 8)
LOAD_FACTOR = 1.25
LOAD_CAP_FLOOR = 8


@dataclass(frozen=True)
class PodModel:
    """The emulator pod `bench organic` starts (its flags' defaults)."""

    kv_tokens: int = 12_000
    prefill_tps: float = 1_500.0
    prefill_overhead_s: float = EmulatorConfig().prefill_overhead_s
    decode_tps: float = EmulatorConfig().decode_tps
    max_tokens: int = 4  # each answer streams this many tokens

    def prefill_s(self, uncached_tokens: int) -> float:
        return self.prefill_overhead_s + uncached_tokens / self.prefill_tps

    @property
    def answer_s(self) -> float:
        """From the first token to the last: when the caller's next turn may start."""
        return (self.max_tokens - 1) / self.decode_tps


class Pods:
    """Each pod: a prefix cache, the time its prefill queue empties, and the ends of the
    answers in flight there, which bounded load reads."""

    def __init__(self, members: int, model: PodModel) -> None:
        self.model = model
        self.caches = [PrefixCache(max(1, model.kv_tokens // BLOCK_SIZE)) for _ in range(members)]
        self.free_at = [0.0] * members
        self._ends: list[list[float]] = [[] for _ in range(members)]

    def finish_at(self, member: int, at: float, chain: Sequence[int], tokens: int) -> float:
        """When a prefill sent to `member` at `at` would end (nothing changes)."""
        uncached = tokens - self.caches[member].hit_blocks(chain, tokens) * BLOCK_SIZE
        return max(at, self.free_at[member]) + self.model.prefill_s(uncached)

    def serve(self, member: int, at: float, chain: Sequence[int], tokens: int) -> float:
        """Queue the prefill on `member`; its first token's time."""
        done = self.finish_at(member, at, chain, tokens)
        self.free_at[member] = done
        self.caches[member].allocate(chain)
        self.caches[member].release(chain)
        self._ends[member].append(done + self.model.answer_s)
        return done

    def loads(self, at: float) -> array.array[int]:
        """Every request in flight on each pod at `at`: what the sidecars' default fleet
        view counts (the pods' running + waiting), without its polling lag."""
        for ends in self._ends:
            ends[:] = [end for end in ends if end > at]
        return array.array("q", (len(ends) for ends in self._ends))


def _bounded(
    ring: _core.HashTable, key: int, home: int, loads: array.array[int], min_cap: int
) -> int:
    """The sidecar's bounded-load pick (contract 4b) from `home`, at the default factor."""
    url, _ = ring.pick_among(key, loads, (home,), LOAD_FACTOR, min_cap, sum(loads))
    return ring.members.index(url)


# A router of the model: (request, its block chain, its tokens, arrival, the pods) -> member
Chooser = Callable[[OrganicRequest, Sequence[int], int, float, Pods], int]


def window(ring: _core.HashTable, chat: bool) -> Chooser:
    """v1 in one sidecar: the first 4,096 bytes' ring owner, under bounded load."""

    def choose(
        request: OrganicRequest, chain: Sequence[int], tokens: int, at: float, pods: Pods
    ) -> int:
        text = request.messages[0][1] if chat else request.prompt
        key = _core.route_key(text.encode("utf-8")[:WINDOW_BYTES])
        home = ring.members.index(ring.owner(key))
        return _bounded(ring, key, home, pods.loads(at), LOAD_CAP_FLOOR)

    return choose


def sidecars(ring: _core.HashTable, chat: bool, count: int, pin_flows: bool = False) -> Chooser:
    """`count` sidecars' organic routing (each its own tables and counts), requests spread
    over them as bench organic spreads them (`pin_flows`: a flow's to one)."""
    routers = [OrganicRouter(AnchorTable()) for _ in range(count)]

    def choose(
        request: OrganicRequest, chain: Sequence[int], tokens: int, at: float, pods: Pods
    ) -> int:
        router = routers[router_of(request, count, pin_flows)]
        keys = organic_keys(router, request, chat)
        home = router.homes(ring, keys)
        member = _bounded(ring, keys.family, home, pods.loads(at), LOAD_CAP_FLOOR)
        router.sent(ring, ring.members[member], keys)
        return member

    return choose


def greedy(
    request: OrganicRequest, chain: Sequence[int], tokens: int, at: float, pods: Pods
) -> int:
    """Perfect information: where this request's prefill would end first."""
    ends = [pods.finish_at(m, at, chain, tokens) for m in range(len(pods.free_at))]
    return ends.index(min(ends))


def ttfts(
    trace: OrganicTrace,
    members: int,
    choose: Chooser,
    model: PodModel = PodModel(),
    warmup_s: float = 10.0,
    pods: Pods | None = None,
) -> list[float]:
    """Modelled TTFT (s) of every request sent at or after `warmup_s`, flows closed loop
    (on `pods` when given, else new ones of `model`)."""
    pods = pods or Pods(members, model)
    model = pods.model
    arrivals = [(flow.start_s, flow.requests[0].seq) for flow in trace.flows if flow.requests]
    heapq.heapify(arrivals)
    following = {
        earlier.seq: later
        for flow in trace.flows
        for earlier, later in zip(flow.requests, flow.requests[1:], strict=False)
    }
    times: list[float] = []
    while arrivals:  # in arrival order, so each pod's queue is served first come first served
        at, seq = heapq.heappop(arrivals)
        request = trace.requests[seq]
        data = request.prompt.encode("utf-8")
        chain, tokens = block_hashes(data), count_tokens(data)
        first_token = pods.serve(choose(request, chain, tokens, at, pods), at, chain, tokens)
        if at >= warmup_s:
            times.append(first_token - at)
        after = following.get(seq)
        if after is not None:
            heapq.heappush(arrivals, (first_token + model.answer_s + after.gap_s, after.seq))
    return times


def floor_ttfts(
    trace: OrganicTrace, model: PodModel = PodModel(), warmup_s: float = 10.0
) -> list[float]:
    """Every request at its ceiling hits, never waiting (sent at its nominal time)."""
    ceilings = oracle([r.prompt for r in trace.requests])
    return [
        model.prefill_s(c.prompt_tokens - c.cached_tokens)
        for c, r in zip(ceilings, trace.requests, strict=True)
        if r.nominal_at >= warmup_s
    ]


def p99(times: Sequence[float]) -> float:
    ordered = sorted(times)
    return ordered[math.ceil(0.99 * len(ordered)) - 1] if ordered else 0.0


def scaled(params: TraceParams, load: float) -> TraceParams:
    """The trace with every flow rate multiplied by `load` (more callers, same behaviour)."""
    return replace(
        params,
        tenant_rate=params.tenant_rate * load,
        fewshot_rate=params.fewshot_rate * load,
        session_rate=params.session_rate * load,
    )


def sweep(
    seeds: Sequence[int],
    rings: int,
    counts: Sequence[int],
    chat: bool,
    load: float,
    pods: int,
    duration: float = 45.0,
) -> dict[str, list[float]]:
    """p99 (s) per router over seeds x rings (`floor` and `greedy` once per seed's ring)."""
    out: dict[str, list[float]] = {"floor": [], "window": [], "greedy": []}
    for count in counts:
        out[f"sidecar_x{count}"] = []
    for seed in seeds:
        trace = build_trace(scaled(TraceParams(seed=seed, duration_s=duration), load))
        floor = p99(floor_ttfts(trace))
        best = p99(ttfts(trace, pods, greedy))  # no ring: it reads every pod
        for ring_seed in range(rings):
            ring = ring_of(pods, ring_seed)
            out["floor"].append(floor)
            out["greedy"].append(best)
            out["window"].append(p99(ttfts(trace, pods, window(ring, chat))))
            for count in counts:
                out[f"sidecar_x{count}"].append(
                    p99(ttfts(trace, pods, sidecars(ring, chat, count)))
                )
    return out


def describe(p99s: dict[str, list[float]]) -> list[str]:
    """Each router's p99 and the window's p99 over it: the median, and how often >= 1.5."""
    lines = []
    for name, values in p99s.items():
        gains = [w / v for w, v in zip(p99s["window"], values, strict=True) if v > 0]
        lines.append(
            f"  {name:<12} p99 median {1000 * statistics.median(values):6.0f} ms   window / it: "
            f"median {statistics.median(gains):.2f}, >= 1.5 in {sum(g >= 1.5 for g in gains)}"
            f"/{len(gains)}"
        )
    return lines


def against_report(path: str) -> list[str]:
    """The model beside a `bench organic --json` report: each window and organic run's p99 on
    the run's own pods (the gRPC paths; the HTTP ones route alike)."""
    params, runs = read_report(path, ("window", "sidecar"))
    trace = build_trace(TraceParams.of_settings(params))
    model = PodModel(kv_tokens=params["kv_tokens"], prefill_tps=params["prefill_tps"])
    warmup = max(params["warmup"], params.get("measure_after", 0.0))
    lines = []
    for one in runs:
        chat = one.path.endswith("chat")
        choose = (
            window(one.ring, chat)
            if one.policy == "window"
            else sidecars(one.ring, chat, one.sidecars, params.get("pin_flows", False))
        )
        modelled = p99(ttfts(trace, len(one.ring.members), choose, model, warmup))
        lines.append(
            f"{one.path:<14}{one.name:<12} TTFT p99 model {1000 * modelled:5.0f} ms   "
            f"measured {one.run['ttft_ms']['p99']:5.0f} ms"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = sweep_parser(
        __doc__,
        seeds="0,1,2,3,4,5",
        rings=8,
        against="the model beside a bench organic --json report",
    )
    parser.add_argument(
        "--load",
        type=positive_float,
        default=1.0,
        help="the trace's flow rates times this (1: bench organic's defaults)",
    )
    parser.add_argument("--paths", default="raw,chat", help="raw (Complete), chat (Chat), or both")
    args = parser.parse_args(argv)
    if args.against:
        print("\n".join(against_report(args.against)))
        return 0
    seeds, counts = args.seeds, args.sidecars
    for path in args.paths.split(","):
        if path not in ("raw", "chat"):
            parser.error(f"--paths: {path!r} is neither raw nor chat")
        print(f"{path} (load x{args.load:g}, {len(seeds)} seeds x {args.rings} rings):")
        print(
            "\n".join(
                describe(
                    sweep(
                        seeds,
                        args.rings,
                        counts,
                        path == "chat",
                        args.load,
                        args.pods,
                        args.duration,
                    )
                )
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
