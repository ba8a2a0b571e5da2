"""Precise organic routing (`unregistered_routing: precise`): the steps that move an organic
decision by the pods' KV events (applied by kv_events/precise.py).

`to_cached`: the pod holding more of the prompt than the decided one, if it fits its cap;
`to_emptiest`: for a prompt no pod holds, off an over-sent pod; `to_quickest`: the pod whose
first token comes sooner by a margin, within a `DiscardBudget`. Ties break on preference
order then URL, so sidecars that heard the same events agree. Matches are passed in: routing
never imports kv_events. A move weighs what the pod would still compute, not a thin query.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from prefix_sidecar.routing.policy import Policy, first_home
from prefix_sidecar.routing.table import RoutingTable


class BlockSource(Protocol):
    """Where the fleet's blocks are known: this sidecar's own subscriptions
    (kv_events/fleet_blocks.py) or the shared index (kv_index/lookup.py)."""

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
        """`first_home` of `pods` with organic routing's floor, each weighed with what it
        would compute; None: keep the pick."""

        def prefill(pod: str) -> int:
            return max(self.tokens - held.get(pod, 0), 0)

        return first_home(self.policy, self.table, self.key, pods, self.min_cap, prefill)

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


# A cold prompt leaves its organic pick when that pod was sent over this times the fleet's
# mean new content lately; 0: whenever it was sent more than the least-sent pod.
# TTFT model (organic_ttft_precise, 6 seeds x 4 rings): one sidecar's p99 382 ms, 423 at 1.5.
SHED_ABOVE_MEAN = 0.0


def to_emptiest(move: Move, inflow: Mapping[str, float]) -> str | None:
    """For a prompt no pod holds, when the decided pod was sent over SHED_ABOVE_MEAN times
    the mean new content per weight (`inflow`, tokens): the least-sent pod that fits its
    cap among those sent less than both; else None. A cold prompt's later requests follow
    it, and hash alone piles popular tenants onto one pod, which then evicts."""
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


# A sooner pod takes the prompt only when sooner by over this many tokens of the pod's time:
# a move recomputes what the holder had cached. bench organic: TTFT p99 at or below SGLang's
# cache_aware in 22 of 24 cells at 128, 2 of 8 without this step (docs/kv-events.md).
QUEUE_MARGIN_TOKENS = 128


# The queue step may discard at most this share of the cached tokens decisions keep: a move
# to a pod holding less recomputes the difference (moves between equal holders are free).
# bench organic: hit 0.993-1.000 of the ceiling, against 0.989 without (docs/kv-events.md).
DISCARD_SHARE = 0.01
# The most the budget saves up in quiet times, in tokens, so a burst spends at most this
# (4,096 and 65,536 modelled the same: the budget is spent as it is earned).
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
    """The pod whose first token would come first, if sooner than on `current` by over
    QUEUE_MARGIN_TOKENS, under its cap and within `budget` (any discard without one); else
    None. A pod's time: its prefill queue (`backlog`, tokens, membership/prefill_queues.py)
    plus the prompt's tokens it does not hold (`held`)."""

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
