"""Blocks a pod is about to hold (kv_events/expected.py): the prompt this sidecar just sent
there is credited to the pod, block by whole block, for EXPECT_S and no longer, within a
bound on the keys kept."""

from __future__ import annotations

import time

import pytest

from prefix_sidecar.kv_events import expected
from prefix_sidecar.kv_events.block_keys import chain
from prefix_sidecar.kv_events.expected import EXPECT_S, ExpectedBlocks

BLOCK = 16
PROMPT = list(range(5 * BLOCK + 3))  # five whole blocks and a partial one


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_sent_prompt_is_credited_to_its_pod_in_whole_blocks() -> None:
    blocks = ExpectedBlocks(Clock())
    assert blocks.matches(chain(PROMPT, BLOCK), BLOCK) == {}
    blocks.expect("a", chain(PROMPT[: 3 * BLOCK + 5], BLOCK))
    blocks.expect("b", chain(PROMPT, BLOCK))
    assert blocks.matches(chain(PROMPT, BLOCK), BLOCK) == {"a": 3 * BLOCK, "b": 5 * BLOCK}
    other = [7, *PROMPT[1:]]  # the first block differs: nothing after it matches either
    assert blocks.matches(chain(other, BLOCK), BLOCK) == {}


def test_the_credit_lasts_expect_s_and_a_resend_renews_it() -> None:
    clock = Clock()
    blocks = ExpectedBlocks(clock)
    blocks.expect("a", chain(PROMPT, BLOCK))
    clock.now += EXPECT_S / 2
    blocks.expect("b", chain(PROMPT[: 2 * BLOCK], BLOCK))
    blocks.expect("a", chain(PROMPT[:BLOCK], BLOCK))  # a's first block renewed, the rest not
    clock.now += EXPECT_S / 2 + 0.01
    assert blocks.matches(chain(PROMPT, BLOCK), BLOCK) == {"a": BLOCK, "b": 2 * BLOCK}
    clock.now += EXPECT_S
    assert blocks.matches(chain(PROMPT, BLOCK), BLOCK) == {}
    assert blocks._until == {} and len(blocks._order) == 0


def test_the_keys_kept_are_bounded_the_oldest_going_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(expected, "MAX_EXPECTED", 8)
    clock = Clock()
    blocks = ExpectedBlocks(clock)
    blocks.expect("a", chain(PROMPT, BLOCK))  # 5 keys
    clock.now += 0.1
    blocks.expect("b", chain([9, *PROMPT[1:]], BLOCK))  # 5 more: a's two oldest go
    assert len(blocks._order) == 8
    assert blocks.matches(chain(PROMPT, BLOCK), BLOCK) == {}  # a's first block went: no prefix left
    assert blocks.matches(chain([9, *PROMPT[1:]], BLOCK), BLOCK) == {"b": 5 * BLOCK}


def _expect_at_the_bound(pods: int) -> float:
    """Seconds one 2,000-block prompt's expect takes once MAX_EXPECTED keys are held over
    `pods` pods (the best of three)."""
    blocks = ExpectedBlocks(Clock())
    per_pod = expected.MAX_EXPECTED // pods + 1
    for pod in range(pods):
        start = pod * 10**6
        blocks.expect(f"pod{pod}", chain(range(start, start + per_pod * BLOCK), BLOCK))
    best = float("inf")
    for turn in range(3):
        start = 10**9 + turn * 10**6
        began = time.perf_counter()
        blocks.expect("pod0", chain(range(start, start + 2000 * BLOCK), BLOCK))
        best = min(best, time.perf_counter() - began)
    return best


def test_the_oldest_key_goes_at_a_cost_that_does_not_grow_with_the_pods() -> None:
    # Picking the oldest pod by pod held the loop 54 ms for this prompt at 200 pods.
    one, many = _expect_at_the_bound(1), _expect_at_the_bound(200)
    assert many < 3 * one, (one, many)


def test_a_first_token_from_the_pod_ends_the_credits_sent_there_by_then() -> None:
    """The pod has scheduled every request sent to it by then and its events hold their
    blocks: a pod that then evicts the prompt is not credited with it for the rest of
    EXPECT_S. A credit made later, or on another pod, still counts."""
    clock = Clock()
    blocks = ExpectedBlocks(clock)
    keys = chain(PROMPT, BLOCK)
    blocks.expect("a", keys)
    blocks.expect("b", keys)
    sent_at = clock.now
    clock.now += 0.1
    blocks.expect("a", chain(PROMPT[: 2 * BLOCK], BLOCK))  # sent after: its prefill is ahead
    clock.now += 0.1
    blocks.prefilled("a", sent_at)
    assert blocks.matches(keys, BLOCK) == {"a": 2 * BLOCK, "b": 5 * BLOCK}
    blocks.prefilled("a", sent_at - 1.0)  # an older request's first token, late: no change
    blocks.prefilled("b", sent_at - 1.0)
    assert blocks.matches(keys, BLOCK) == {"a": 2 * BLOCK, "b": 5 * BLOCK}
    blocks.prefilled("a", clock.now)
    assert blocks.matches(keys, BLOCK) == {"b": 5 * BLOCK}
    clock.now += 0.1
    blocks.expect("a", keys)  # sent again
    assert blocks.matches(keys, BLOCK) == {"a": 5 * BLOCK, "b": 5 * BLOCK}
    blocks.prefilled("c", clock.now)  # a pod with no credits keeps no mark
    clock.now += EXPECT_S + 1.0
    assert blocks.matches(keys, BLOCK) == {}
    assert blocks._settled == {}  # marks go with their pods' last credits: bounded by them
