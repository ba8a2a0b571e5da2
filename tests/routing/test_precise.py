"""routing/precise.py's pick: the pod holding most of a prompt, in a deterministic order,
only under its cap, and never one holding no more than the organic pick."""

from __future__ import annotations

from prefix_sidecar.routing.precise import (
    DISCARD_BURST_TOKENS,
    DISCARD_SHARE,
    QUEUE_MARGIN_TOKENS,
    DiscardBudget,
    Move,
    request_text,
    to_cached,
    to_emptiest,
    to_quickest,
)
from prefix_sidecar.routing.prefix_affinity import PrefixAffinity
from prefix_sidecar.routing.random_pick import RandomPick

from .conftest import pods, serving_pool

POLICY = PrefixAffinity(load_factor=1.25, load_unit="requests")
A, B, C, D = pods(4)


def pick(
    matches: dict[str, int], loads: dict[str, int] | None = None, policy: object = POLICY
) -> str | None:
    pool = serving_pool([A, B, C, D])
    for url, count in (loads or {}).items():
        for _ in range(count):
            pool.acquire(url)
    return to_cached(Move(policy, pool.table, 7, A, [A, B, C, D], 8), matches)  # type: ignore[arg-type]


def test_the_pod_holding_the_most_takes_it_and_ties_go_in_preference_order() -> None:
    assert pick({A: 1, B: 3, C: 5}) == C
    assert pick({A: 1, D: 4, C: 4}) == C  # C comes before D in the decision's order
    assert pick({A: 5, B: 5}) is None  # no more than the organic pick holds
    assert pick({}) is None


def test_a_pod_over_its_cap_is_passed_for_the_next() -> None:
    assert pick({B: 6, C: 4}, loads={B: 40}) == C
    assert pick({B: 6}, loads={B: 40}) is None


def test_counting_tokens_a_move_weighs_what_the_pod_would_still_compute() -> None:
    """A 6,000-token prompt: B holds 5,888 of it, C 1,024. With 4,000 tokens in flight on
    each, B fits under the 5,120-token floor with the 112 it computes; C would compute
    4,976 more and does not (weighed as a thin query it did: bench organic's precise_x4
    piled 40 moves a sidecar onto one pod)."""
    policy = PrefixAffinity(load_factor=1.25, load_unit="tokens")
    pool = serving_pool([A, B, C, D], load_unit="tokens")
    for url in (B, C):
        pool.acquire(url, prefill=4000 - 128)
    table = pool.table
    order = [A, B, C, D]
    move = Move(policy, table, 7, A, order, 5120, 6000)
    assert to_cached(move, {B: 5888, C: 1024}) == B
    assert to_cached(move, {C: 1024}) is None


def test_a_baseline_policy_keeps_its_own_pick() -> None:
    assert pick({B: 6}, policy=RandomPick()) is None


def test_what_tokenize_is_asked() -> None:
    assert request_text(False, (), "hello") == {"prompt": "hello"}
    chat = request_text(True, (("system", "s"), ("user", "u")), "s")
    assert chat == {
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    }


def place(inflow: dict[str, float], loads: dict[str, int] | None = None) -> str | None:
    pool = serving_pool([A, B, C, D])
    for url, count in (loads or {}).items():
        for _ in range(count):
            pool.acquire(url)
    return to_emptiest(Move(POLICY, pool.table, 7, A, [A, B, C, D], 8), inflow)


def test_a_cold_prompt_goes_to_the_pod_sent_the_least_new_content() -> None:
    assert place({}) is None  # nothing sent yet: the hash pick, as every sidecar agrees
    assert place({A: 900, B: 1000, C: 1200, D: 900}) is None  # its pick was sent the least
    assert place({A: 1200, B: 1000, C: 900, D: 900}) == C  # sent more: the least-sent, in order
    # A was sent 3,000 of 4,000 tokens (mean 1,000): the least-sent pod, ties in order
    assert place({A: 3000, B: 500, C: 500}) == D
    assert place({A: 3000, B: 500, C: 0, D: 500}) == C
    assert place({A: 3000, C: 0, D: 500}, loads={B: 40}) == C  # B over its cap: passed


def test_a_pod_whose_first_token_comes_sooner_by_the_margin_takes_the_prompt() -> None:
    """A 1,000-token prompt A holds 900 of: A's 100 to compute behind a queue of 2,000
    tokens lose to B's 1,000 with none; behind 800 (900 against 1,000) A keeps it, and a
    pod sooner by no more than QUEUE_MARGIN_TOKENS does not take it."""
    pool = serving_pool([A, B, C, D], load_unit="tokens")
    move = Move(PrefixAffinity(1.25, "tokens"), pool.table, 7, A, [A, B, C, D], 5120, 1000)
    held = {A: 900}
    busy = {A: 2000.0, B: 0.0, C: 500.0, D: 0.0}
    assert to_quickest(move, A, held, busy) == B  # B and D tie: the decision's order
    assert to_quickest(move, A, held, {A: 800.0}) is None
    edge = 1000 - 100 + QUEUE_MARGIN_TOKENS
    assert to_quickest(move, A, held, {A: edge - 1.0}) is None
    assert to_quickest(move, A, held, {A: edge + 1.0}) == B


def test_the_sooner_pod_must_fit_under_its_cap() -> None:
    pool = serving_pool([A, B, C, D], load_unit="tokens")
    pool.acquire(B, prefill=9000)
    move = Move(PrefixAffinity(1.25, "tokens"), pool.table, 7, A, [A, B, C, D], 5120, 1000)
    assert to_quickest(move, A, {A: 900}, {A: 3000.0, B: 0.0, C: 1500.0}) == D


def test_a_move_may_discard_only_the_cached_tokens_the_budget_allows() -> None:
    """A and C both hold 900 of the prompt, B none: with 899 tokens to discard the move goes
    to C behind its queue (it discards nothing) rather than to B, which comes sooner; with
    900 to B. A pod holding as much is always allowed."""
    pool = serving_pool([A, B, C, D], load_unit="tokens")
    move = Move(PrefixAffinity(1.25, "tokens"), pool.table, 7, A, [A, B, C, D], 5120, 1000)
    held, busy = {A: 900, C: 900, D: 400}, {A: 3000.0, B: 0.0, C: 1500.0, D: 3000.0}
    assert to_quickest(move, A, held, busy, saved(0.0)) == C
    assert to_quickest(move, A, held, busy, saved(899.0)) == C
    assert to_quickest(move, A, held, busy, saved(900.0)) == B
    assert to_quickest(move, A, {A: 900}, {A: 3000.0}, saved(0.0)) is None


def saved(tokens: float) -> DiscardBudget:
    budget = DiscardBudget()
    budget.tokens = tokens
    return budget


def test_the_discard_budget_earns_a_share_of_what_is_kept_and_saves_up_a_burst() -> None:
    budget = DiscardBudget()
    assert budget.tokens == 0.0  # a new sidecar has kept nothing yet
    for _ in range(100):
        budget.settle(1000, 1000)  # stayed: 1,000 cached tokens kept
    assert budget.tokens == 100 * DISCARD_SHARE * 1000
    budget.settle(1000, 200)  # moved: 800 recomputed, 200 kept
    assert budget.tokens == 100 * DISCARD_SHARE * 1000 - 800 + DISCARD_SHARE * 200
    for _ in range(10_000):
        budget.settle(100_000, 100_000)
    assert budget.tokens == DISCARD_BURST_TOKENS
