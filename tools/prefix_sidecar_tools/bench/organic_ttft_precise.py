"""Precise routing and SGLang's cache_aware in the TTFT queue model (organic_ttft.py): TTFT
p99 and hit as a fraction of the ceiling over seeds x rings, in seconds, deterministic.

`bench organic`'s p99 rests on five or so requests of ~460, and its runs on this box differ
by 2x where nothing changed (precise 406-1,239 ms in runs of one commit); this model gives
the same trace the same answer every time, so that a change of rule is judged on 24 trace
and ring pairs, then confirmed on the bench. The pods are organic_ttft's (one FIFO prefill
queue before an LRU cache each); the routers:
- `radix`: SGLang's cache_aware, one central router (organic_radix.CacheAwareRouter), its
  in-flight counts read off the pods, its tree cut to 4x a pod's KV every 2 modelled s;
- `precise_xK`: K sidecars with precise routing (routing/precise.py, kv_events/precise.py),
  each its own organic router, in-flight tokens and content inflow. What each knows the pods
  hold: the pods' events (each prefill's blocks from its end until the pod evicts them), and
  what it sent itself, for EXPECT_S or until its first token. Then as the sidecar: the
  organic pick under bounded load in tokens; a prompt some pod holds more of, to the pod
  holding most that fits; a prompt no pod holds, off its pick to the pod sent the least new
  content when its pick was sent over `shed` times the mean;
  then to the pod whose first token comes sooner by QUEUE_MARGIN_TOKENS, its prefill queue
  as the sidecar's own sends built it (membership/prefill_queues.py on the model's clock).
  Loads are every request in flight on a pod (the fleet view, without its polling lag).

    python -m prefix_sidecar_tools.bench.organic_ttft_precise             (shed 0 and 1.5)
    python -m prefix_sidecar_tools.bench.organic_ttft_precise --sheds 0,0.8,1.5 --paths chat
"""

from __future__ import annotations

import array
import heapq
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefix_sidecar import _core
from prefix_sidecar.membership.prefill_queues import PrefillQueues
from prefix_sidecar.routing.anchors import AnchorTable
from prefix_sidecar.routing.cost import DECODE_TOKENS, ORGANIC_REQUEST_TOKENS, organic_prefill
from prefix_sidecar.routing.organic import LOAD_CAP_FLOOR, OrganicRouter
from prefix_sidecar.routing.precise import QUEUE_MARGIN_TOKENS, DiscardBudget
from prefix_sidecar_tools.bench.organic_oracle import oracle
from prefix_sidecar_tools.bench.organic_radix import CacheAwareRouter
from prefix_sidecar_tools.bench.organic_replay import organic_keys, ring_of, sweep_parser
from prefix_sidecar_tools.bench.organic_trace import (
    OrganicRequest,
    OrganicTrace,
    TraceParams,
    build_trace,
    router_of,
)
from prefix_sidecar_tools.bench.organic_ttft import LOAD_FACTOR, Chooser, PodModel, Pods, p99, ttfts
from prefix_sidecar_tools.emulator.config import BLOCK_SIZE
from prefix_sidecar_tools.emulator.prefix_cache import PrefixCache
from prefix_sidecar_tools.vllm.reports import common_length

TIME_SCALE = 6.0  # bench organic's modelled seconds per real second
EXPECT_S = 2.0 * TIME_SCALE  # kv_events/expected.py EXPECT_S, modelled
INFLOW_TAU_S = 60.0 * TIME_SCALE  # kv_events/expected.py INFLOW_TAU_S, modelled
FLOOR = LOAD_CAP_FLOOR * ORGANIC_REQUEST_TOKENS  # organic picks' min_cap in tokens
RADIX_EVICTION_S = 2.0


class TokenPods(Pods):
    """The model's pods, each request in flight weighed in tokens as the sidecar's load unit
    weighs it: what it computes there, plus DECODE_TOKENS, until its answer ends. `events`:
    what their KV events have said, the same for every sidecar."""

    def __init__(self, members: int, model: PodModel) -> None:
        super().__init__(members, model)
        self._weights: list[list[tuple[float, int]]] = [[] for _ in range(members)]
        self.hit_tokens = self.prompt_tokens = 0
        self.events = EventView(self.caches)

    def serve(self, member: int, at: float, chain: Sequence[int], tokens: int) -> float:
        cached = self.caches[member].hit_blocks(chain, tokens) * BLOCK_SIZE
        self.hit_tokens += cached
        self.prompt_tokens += tokens
        done = super().serve(member, at, chain, tokens)
        self._weights[member].append((done + self.model.answer_s, tokens - cached + DECODE_TOKENS))
        return done

    def token_loads(self, at: float) -> array.array[int]:
        for weights in self._weights:
            weights[:] = [w for w in weights if w[0] > at]
        return array.array("q", (sum(w for _, w in weights) for weights in self._weights))


# The view's record of stored blocks never evicts on its own: what leaves is what a pod evicts.
VIEW_BLOCKS = 1 << 40


@dataclass
class EventView:
    """What the pods' events have said by now: a pod's blocks are known from the end of the
    prefill that stored them (BlockStored) until the pod evicts them (BlockRemoved, which a
    pod sends as it evicts: read here off the pod's own cache, `pods`). A view with an LRU of
    its own instead drifted from the pods' under eviction: on a trace four times as long it
    credited pods with blocks they had evicted (25 decisions, 13,552 tokens, on seed 0, ring
    1), and those requests queued behind prefills nobody had counted (p99 943 ms)."""

    pods: Sequence[PrefixCache]
    stored_blocks: list[PrefixCache] = field(init=False)
    pending: list[tuple[float, int, int, Sequence[int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stored_blocks = [PrefixCache(VIEW_BLOCKS) for _ in self.pods]

    def stored(self, done: float, member: int, chain: Sequence[int]) -> None:
        heapq.heappush(self.pending, (done, len(self.pending), member, chain))

    def advance(self, at: float) -> None:
        while self.pending and self.pending[0][0] <= at:
            _, _, member, chain = heapq.heappop(self.pending)
            self.stored_blocks[member].allocate(chain)
            self.stored_blocks[member].release(chain)

    def blocks(self, member: int, chain: Sequence[int], tokens: int) -> int:
        """The prompt's leading blocks the events say `member` holds now."""
        told = self.stored_blocks[member].hit_blocks(chain, tokens)
        return min(told, self.pods[member].hit_blocks(chain, tokens))


@dataclass
class PreciseSidecar:
    router: OrganicRouter
    inflow: list[tuple[float, float]]  # per member: (new tokens sent, as of when)
    expected: list[tuple[float, int, Sequence[int]]] = field(default_factory=list)
    # The pods' prefill queues as this sidecar's sends fill them (membership/prefill_queues.py
    # on the model's clock), and its requests without their first token: (when it comes,
    # member, tokens it computes, when it was sent).
    now: list[float] = field(default_factory=lambda: [0.0])
    queues: PrefillQueues = field(init=False)
    discards: DiscardBudget = field(default_factory=DiscardBudget)
    waiting: list[tuple[float, int, int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.queues = PrefillQueues(clock=lambda: self.now[0])

    def backlog(self, members: Sequence[str], at: float) -> list[float]:
        """Per member, its prefill queue in tokens as this sidecar estimates it at `at`,
        having seen the first tokens that came by then."""
        self.waiting.sort()
        while self.waiting and self.waiting[0][0] <= at:
            self.now[0], member, tokens, sent_at = self.waiting.pop(0)
            self.queues.first_token(members[member], tokens, sent_at)
        self.now[0] = at
        backlog = self.queues.backlog_tokens(members)
        return [backlog[url] for url in members]

    def send(
        self, members: Sequence[str], member: int, tokens: int, at: float, first: float
    ) -> None:
        self.now[0] = at
        sent_at = self.queues.sent(members[member], tokens)
        self.waiting.append((first, member, tokens, sent_at))

    def fill(self, member: int, at: float) -> float:
        tokens, when = self.inflow[member]
        return tokens * math.exp(-(at - when) / INFLOW_TAU_S)

    def emptier(self, decided: int, at: float, shed: float) -> list[int]:
        """For a prompt no pod holds: the pods sent less new content than `decided` and the
        mean, least first, when `decided` was sent over `shed` times the mean
        (routing/precise.py to_emptiest); else none."""
        fills = [self.fill(m, at) for m in range(len(self.inflow))]
        mean = sum(fills) / len(fills)
        if fills[decided] <= shed * mean:
            return []
        below = min(mean, fills[decided])
        return sorted((m for m in range(len(fills)) if fills[m] < below), key=fills.__getitem__)

    def held(self, view: EventView, member: int, chain: Sequence[int], tokens: int) -> int:
        blocks = view.blocks(member, chain, tokens)
        for _, sent_to, sent in self.expected:
            if sent_to == member:
                blocks = max(blocks, common_length(sent, chain))
        return min(blocks * BLOCK_SIZE, tokens)


def _first_fitting(
    ring: _core.HashTable,
    key: int,
    candidates: Sequence[int],
    loads: array.array[int],
    prefill: Callable[[int], int],
) -> int | None:
    """The first candidate the bounded-load pick keeps as a one-pod home set, weighed with
    what it would compute there (routing/precise.py Move.first_fitting)."""
    for member in candidates:
        cost = prefill(member) + DECODE_TOKENS
        url, _ = ring.pick_among(key, loads, (member,), LOAD_FACTOR, FLOOR, sum(loads), cost)
        if ring.members.index(url) == member:
            return member
    return None


def precise(
    ring: _core.HashTable,
    chat: bool,
    sidecars: int,
    shed: float,
    saved: float = 0.0,
) -> Chooser:
    """K sidecars with precise routing, requests spread over them as bench organic does,
    each with `saved` cached tokens to discard at the start (its DiscardBudget); all hear
    the same events (the pods' `events`)."""
    members = len(ring.members)
    sides = [
        PreciseSidecar(OrganicRouter(AnchorTable()), [(0.0, 0.0)] * members)
        for _ in range(sidecars)
    ]
    for side in sides:
        side.discards.tokens = saved

    def choose(
        request: OrganicRequest, chain: Sequence[int], tokens: int, at: float, pods: Pods
    ) -> int:
        assert isinstance(pods, TokenPods)
        view = pods.events
        side = sides[router_of(request, sidecars, False)]
        view.advance(at)
        side.expected = [e for e in side.expected if e[0] > at]
        keys = organic_keys(side.router, request, chat)
        loads = pods.token_loads(at)
        home = side.router.homes(ring, keys)
        url, _ = ring.pick_among(
            keys.family,
            loads,
            (home,),
            LOAD_FACTOR,
            FLOOR,
            sum(loads),
            organic_prefill(keys, tokens) + DECODE_TOKENS,
        )
        side.router.sent(ring, url, keys)
        decided = ring.members.index(url)
        held = [side.held(view, m, chain, tokens) for m in range(members)]
        if any(held):  # to the pod holding the most, if it fits: routing/precise.py to_cached
            better = sorted(
                (m for m in range(members) if held[m] > held[decided]),
                key=held.__getitem__,
                reverse=True,
            )
            moved = _first_fitting(ring, keys.family, better, loads, lambda m: tokens - held[m])
        else:
            emptier = side.emptier(decided, at, shed)
            moved = _first_fitting(ring, keys.family, emptier, loads, lambda m: tokens)
        chosen = decided if moved is None else moved
        # then to the pod whose first token comes first by a margin: routing/precise.py
        # to_quickest
        backlog = side.backlog(ring.members, at)
        cost = [backlog[m] + tokens - held[m] for m in range(members)]
        allows = side.discards.allows
        sooner = sorted(
            (
                m
                for m in range(members)
                if cost[m] < cost[chosen] - QUEUE_MARGIN_TOKENS and allows(held[chosen], held[m])
            ),
            key=cost.__getitem__,
        )
        quick = _first_fitting(ring, keys.family, sooner, loads, lambda m: tokens - held[m])
        chosen, was = (chosen if quick is None else quick), chosen
        side.discards.settle(held[was], held[chosen])
        side.inflow[chosen] = (side.fill(chosen, at) + tokens - held[chosen], at)
        first = pods.finish_at(chosen, at, chain, tokens)
        side.expected.append((min(at + EXPECT_S, first), chosen, chain))
        side.send(ring.members, chosen, tokens - held[chosen], at, first)
        view.stored(first, chosen, chain)
        return chosen

    return choose


def radix(ring: _core.HashTable, chat: bool, kv_tokens: int) -> Chooser:
    """One central cache_aware router over the ring's pods."""
    now = [0.0]
    router = CacheAwareRouter(
        ring.members,
        max_tree_chars=4 * kv_tokens,
        eviction_interval_s=RADIX_EVICTION_S,
        clock=lambda: now[0],
    )

    def choose(
        request: OrganicRequest, chain: Sequence[int], tokens: int, at: float, pods: Pods
    ) -> int:
        now[0] = at
        router.evict_if_due()
        for member, load in enumerate(pods.loads(at)):
            router.loads[ring.members[member]] = load
        text = "".join(text for _, text in request.messages) if chat else request.prompt
        return ring.members.index(router.select(text))

    return choose


@dataclass(frozen=True)
class Outcome:
    p99_s: float
    fraction: float  # hit tokens / the oracle ceiling's


def outcome(trace: OrganicTrace, members: int, choose: Chooser, ceiling: float) -> Outcome:
    pods = TokenPods(members, PodModel())
    times = ttfts(trace, members, choose, pods=pods)
    return Outcome(p99(times), pods.hit_tokens / pods.prompt_tokens / ceiling)


def sweep(
    seeds: Sequence[int],
    rings: int,
    counts: Sequence[int],
    sheds: Sequence[float],
    chat: bool,
    duration_s: float = 45.0,
) -> dict[str, list[Outcome]]:
    """Each router's outcome per (seed, ring), radix first."""
    kv_tokens = PodModel().kv_tokens
    out: dict[str, list[Outcome]] = {"radix": []}
    for seed in seeds:
        trace = build_trace(TraceParams(seed=seed, duration_s=duration_s))
        ceilings = oracle([r.prompt for r in trace.requests])
        ceiling = sum(c.cached_tokens for c in ceilings) / sum(c.prompt_tokens for c in ceilings)
        for ring_seed in range(rings):
            ring = ring_of(4, ring_seed)
            routers = [("radix", radix(ring, chat, kv_tokens))]
            routers += [
                (f"precise_x{count} shed {shed:g}", precise(ring, chat, count, shed))
                for shed in sheds
                for count in counts
            ]
            for name, choose in routers:
                out.setdefault(name, []).append(outcome(trace, 4, choose, ceiling))
    return out


def describe(outcomes: dict[str, list[Outcome]]) -> list[str]:
    """Per router: TTFT p99 median and worst, how often within 5 % of radix's on the same
    trace and ring, and hit as a fraction of the ceiling (median, lowest)."""
    radix_p99 = [o.p99_s for o in outcomes["radix"]]
    lines = []
    for name, runs in outcomes.items():
        p99s = [o.p99_s for o in runs]
        level = sum(p <= 1.05 * r for p, r in zip(p99s, radix_p99, strict=True))
        fractions = [o.fraction for o in runs]
        lines.append(
            f"  {name:<22} p99 median {1000 * statistics.median(p99s):5.0f} ms, worst "
            f"{1000 * max(p99s):5.0f}; <= 1.05 x radix in {level:2d}/{len(runs)}; hit "
            f"{statistics.median(fractions):.3f} of the ceiling, lowest {min(fractions):.3f}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = sweep_parser(__doc__, seeds="0,1,2,3,4,5", rings=4, against="(not read here)")
    parser.add_argument(
        "--sheds",
        default="0,1.5",
        help="routing/precise.py SHED_ABOVE_MEAN values to model (0,1.5)",
    )
    parser.add_argument("--paths", default="raw,chat", help="raw (Complete), chat (Chat), or both")
    args = parser.parse_args(argv)
    sheds = [float(value) for value in args.sheds.split(",")]
    for path in args.paths.split(","):
        if path not in ("raw", "chat"):
            parser.error(f"--paths: {path!r} is neither raw nor chat")
        print(f"{path} ({len(args.seeds)} seeds x {args.rings} rings, 4 pods):")
        outcomes = sweep(
            args.seeds, args.rings, args.sidecars, sheds, path == "chat", args.duration
        )
        print("\n".join(describe(outcomes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
