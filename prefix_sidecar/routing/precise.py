"""Precise organic routing (unregistered_routing: precise, issue 29): an unregistered prompt
goes to the pod that holds the longest prefix of it, as the pods' KV events say, when that
is more than the organic decision's pod holds and the pod fits under its bounded-load cap.

Algorithm: the pods holding more whole blocks of the prompt than the decided pod, most
blocks first, ties in the decision's preference order and then by URL (so sidecars that
heard the same events agree); the first one the policy answers HOME for as a one-pod home
set (under its cap, with organic routing's floor) takes the request. None of them fits, or
none holds more: the organic decision stands, and with it what organic routing does for a
prompt no pod holds (its family's home set, balanced starts). Last, the pod whose first token
would come first, counting its prefill queue as this sidecar has filled it, takes the request
when that is sooner by a margin and it fits (to_quickest), and throws away cached tokens only
within a budget (DiscardBudget).

The matches are passed in (pod -> cached tokens): routing never imports kv_events. With load
counted in tokens a move weighs what the pod would still compute, the prompt past its
cached blocks: weighed as a thin query, four sidecars each let 40 moves onto one pod under
organic's floor (`bench organic --policies precise`, http-complete precise_x4: 0.896 of the
ceiling, TTFT p99 4,875 ms).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from prefix_sidecar.routing.pick import Branch, Pick
from prefix_sidecar.routing.policy import Policy
from prefix_sidecar.routing.table import RoutingTable


class BlockSource(Protocol):
    """Where the fleet's blocks are known: this sidecar's own subscriptions
    (kv_events/fleet_blocks.py) or the shared index (kv_index/source.py)."""

    async def block_sizes(self) -> set[int]:
        """The block sizes the pods report; none while no pod's blocks are known (then a
        prompt is not even tokenized)."""

    async def longest(self, keys_at: Callable[[int], Sequence[int]]) -> dict[str, int] | None:
        """Per pod, the tokens of a prompt it holds in whole blocks from the first on (its
        blocks times its block size), from the prompt's chained block keys at each block
        size (`keys_at`); None when the source did not answer in time."""


class Move(NamedTuple):
    """An organic decision that precise routing may move: where it stands, and what the
    request weighs (`tokens`, the prompt's) under the caps (organic routing's `min_cap`)."""

    policy: Policy
    table: RoutingTable
    key: int
    decided: str
    preference: Sequence[str]
    min_cap: int
    tokens: int = 0

    def first_fitting(self, pods: Sequence[str], held: Mapping[str, int]) -> str | None:
        """The first of `pods` the policy answers HOME for as a one-pod home set (under its
        cap, with organic routing's floor), weighed with what it would compute."""
        for pod in pods:
            index = self.table.index.get(pod)
            if index is None:
                continue
            prefill = max(self.tokens - held.get(pod, 0), 0)
            pick = Pick(self.key, 1, (index,), self.min_cap, prefill)
            _, branch = self.policy.select(self.table, pick)
            if branch is Branch.HOME:  # the baselines never answer HOME: they keep their pick
                return pod
        return None

    def rank(self) -> dict[str, int]:
        return {pod: n for n, pod in enumerate(self.preference)}


def to_cached(move: Move, matches: Mapping[str, int]) -> str | None:
    """The pod holding more of the prompt than the decided one that fits, or None.
    `matches` counts tokens: a pod is weighed with what it would compute."""
    floor = matches.get(move.decided, 0)
    rank = move.rank()
    better = [pod for pod, held in matches.items() if held > floor]
    better.sort(key=lambda pod: (-matches[pod], rank.get(pod, len(rank)), pod))
    return move.first_fitting(better, matches)


# A cold prompt leaves its organic pick when that pod was sent more than this times the
# fleet's mean of new content lately: 0, whenever it was sent more than the least-sent pod.
# In the TTFT model of bench organic's trace (6 seeds x 4 rings,
# `python -m prefix_sidecar_tools.bench.organic_ttft_precise --sheds 0,0.8,1.5`) 0 against
# 1.5: one sidecar's p99 median 382 ms against 423 (SGLang's cache_aware 424), worst 447
# against 1,857, hit 1.000 against 0.998 of the ceiling; four sidecars' 380/419 against
# 455/411 (raw/chat), hit 0.996 both. On `bench organic`, three runs each, alternated: TTFT
# p99 438-574 ms against 419-585 with one sidecar, 375-590 against 445-764 with four, hit
# 0.997-1.000 against 0.990-1.000. Sidecars count only their own requests, so four may
# send concurrent starts of one new prompt to two pods; the model shows that costing less
# than the queues that 1.5 let build on the pods holding the popular prompts.
SHED_ABOVE_MEAN = 0.0


def to_emptiest(move: Move, inflow: Mapping[str, float]) -> str | None:
    """For a prompt no pod holds, when the decided pod was sent over SHED_ABOVE_MEAN times
    the mean new content lately for its weight (`inflow`, tokens): the pod sent the least
    (less than the decided pod and the mean), if it fits under its cap; else None. Where a
    cold prompt lands, its later requests follow: placed by hash alone, popular tenants that
    hash alike pile their content onto one pod, which then evicts (bench organic: one pod of
    four sent 56 % of the requests, 0.976 of the ceiling)."""
    table, ring = move.table, move.table.ring
    if ring is None or move.decided not in table.index:
        return None

    def fill(pod: str) -> float:
        return inflow.get(pod, 0.0) / float(ring.weights[table.index[pod]])

    mean = sum(fill(pod) for pod in table.index) / len(table.index)
    if fill(move.decided) <= SHED_ABOVE_MEAN * mean:
        return None  # nothing sent yet: the hash pick, on which every sidecar agrees
    rank = move.rank()
    below = min(mean, fill(move.decided))
    emptier = [pod for pod in table.index if fill(pod) < below]
    emptier.sort(key=lambda pod: (fill(pod), rank.get(pod, len(rank)), pod))
    return move.first_fitting(emptier, {})


# A pod whose first token would come sooner takes the prompt only when sooner by more than
# this many tokens of the pod's time: a move recomputes what the holder had cached.
# `bench organic --policies precise,radix` (seed 0, time x6, four paths; alternated with the
# commit before): one sidecar's TTFT p99 at or below SGLang's cache_aware in 22 of 24 cells
# at 128 (6 runs), 13 of 16 at 256 (4 runs), 4 of 8 at 192, 2 of 8 without this step; hit
# 0.989-1.000 of the ceiling at 128, 0.992-1.000 at 256, 1.000 without. In the TTFT model
# (`python -m prefix_sidecar_tools.bench.organic_ttft_precise --sheds 0`, 6 seeds x 4 rings,
# raw / chat) one sidecar's p99 median is 344 / 355 ms at 128, 403 / 386 at 256, 382 / 382
# without (cache_aware 424 / 429). docs/kv-events.md has the runs.
QUEUE_MARGIN_TOKENS = 128


# The queue step may throw away at most this share of the cached tokens that decisions keep:
# a move from a pod holding the prompt to one holding less recomputes the difference, which
# the hit rate pays. Moves between pods holding as much are free. Without the budget hit fell
# to 0.989 of the ceiling in 1 of 24 `bench organic` cells. With it, `bench organic
# --policies precise,radix` (seed 0, time x6, four paths, 6 runs): hit 0.993-1.000, TTFT
# p99 at or below the radix router's in 20 of 24 cells (22 of 24 without); over 6 seeds
# (`--time-scale 2 --paths grpc-complete --seeds 0-5`, 3 runs) p99 386, 413 and 369 ms against
# 412, 410 and 420, hit 0.994-0.999 (369 against 414, 0.993-0.999 without). In the TTFT model
# (`--sheds 0`), one sidecar's p99 median 347 / 339 ms raw / chat at 1 %, 404 / 346 at
# 0.5 %, 421 / 390 at none, 344 / 355 unbounded. docs/kv-events.md has the runs.
DISCARD_SHARE = 0.01
# What the budget can save up in quiet times, in tokens, so a burst spends at most this; in
# the model 4,096 and 65,536 gave the same figures (the budget is spent as it is earned).
DISCARD_BURST_TOKENS = 16384


class DiscardBudget:
    """The cached tokens the queue step may still discard: DISCARD_SHARE of what each
    decision keeps is earned, each move spends what it leaves behind (a token bucket)."""

    def __init__(self) -> None:
        self.tokens = 0.0

    def allows(self, was_held: int, held: int) -> bool:
        """Whether a move from a pod holding `was_held` of the prompt's tokens to one
        holding `held` discards no more than the budget holds."""
        return was_held - held <= self.tokens

    def settle(self, was_held: int, held: int) -> None:
        """A request whose pod before the queue step held `was_held` of its tokens went to
        one holding `held`."""
        self.tokens -= max(was_held - held, 0)
        self.tokens = min(self.tokens + DISCARD_SHARE * held, DISCARD_BURST_TOKENS)


def to_quickest(
    move: Move,
    current: str,
    held: Mapping[str, int],
    backlog: Mapping[str, float],
    budget: DiscardBudget | None = None,
) -> str | None:
    """The pod on which the prompt's first token would come first, when sooner than on
    `current` by over QUEUE_MARGIN_TOKENS, under its cap, and discarding no more of the
    tokens `current` holds than `budget` allows (any, without one); else None. A pod's time
    is its prefill queue (`backlog`, this sidecar's estimate in tokens:
    membership/prefill_queues.py) plus what it would compute of the prompt (`held`: tokens
    it holds)."""

    def cost(pod: str) -> float:
        return backlog.get(pod, 0.0) + max(move.tokens - held.get(pod, 0), 0)

    def allowed(pod: str) -> bool:
        return budget is None or budget.allows(held.get(current, 0), held.get(pod, 0))

    limit, rank = cost(current) - QUEUE_MARGIN_TOKENS, move.rank()
    sooner = [pod for pod in move.table.index if cost(pod) < limit and allowed(pod)]
    sooner.sort(key=lambda pod: (cost(pod), rank.get(pod, len(rank)), pod))
    return move.first_fitting(sooner, held)


def request_text(chat: bool, messages: Sequence[tuple[str, str]], prompt: str) -> dict[str, Any]:
    """What /tokenize is asked for an HTTP request: a chat's messages (the first ones the
    front reads: their tokens are a prefix of the whole chat's, all a longest-prefix match
    needs), or the prompt."""
    if chat:
        return {"messages": [{"role": role, "content": text} for role, text in messages]}
    return {"prompt": prompt}
