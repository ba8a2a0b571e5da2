"""Residency of registered prefixes from KV events shaped as vLLM sends them: a long prompt's
blocks in chained events, evictions by engine hash, resets, other traffic not kept."""

from __future__ import annotations

from prefix_sidecar.kv_events.decode import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_sidecar.kv_events.residency import RECENT_BLOCKS, Residency

BLOCK = 4
PREFIX = list(range(100, 111))  # 2 whole blocks and a partial tail


def stored_chunks(
    tokens: list[int], first_hash: int, per_event: int = 1, medium: str | None = None
) -> list[BlockStored]:
    """Whole blocks, `per_event` a BlockStored, chained by parent hash (chunked prefill)."""
    events, parent, blocks = [], None, len(tokens) // BLOCK
    for start in range(0, blocks, per_event):
        indexes = range(start, min(start + per_event, blocks))
        hashes = tuple(first_hash + i for i in indexes)
        ids = tuple(tokens[indexes[0] * BLOCK : (indexes[-1] + 1) * BLOCK])
        events.append(BlockStored(hashes, parent, ids, BLOCK, medium=medium))
        parent = hashes[-1]
    return events


def residency_with_prefix() -> Residency:
    residency = Residency()
    residency.watch_prefix("p", PREFIX)
    for pod in ("a", "b"):
        residency.reset(pod, known=True)
    return residency


def test_a_pod_that_stored_every_whole_block_holds_the_prefix() -> None:
    residency = residency_with_prefix()
    prompt = [*PREFIX, 7, 8, 9, 10, 11]  # the prefix, then a query: 4 whole blocks
    residency.apply("a", tuple(stored_chunks(prompt, 2**63 + 1)))
    residency.apply("b", tuple(stored_chunks(prompt[:BLOCK], 2**63 + 1)))  # the first block only
    assert residency.resident("p") == ["a"]


def test_blocks_in_one_event_or_many_give_the_same_answer() -> None:
    residency = residency_with_prefix()
    residency.apply("a", tuple(stored_chunks(PREFIX, 1, per_event=1)))
    residency.apply("b", tuple(stored_chunks(PREFIX, 1, per_event=2)))
    assert residency.resident("p") == ["a", "b"]


def test_an_eviction_of_one_block_loses_the_prefix() -> None:
    residency = residency_with_prefix()
    residency.apply("a", tuple(stored_chunks(PREFIX, 50)))
    residency.apply("a", (BlockRemoved((51,)),))
    assert residency.resident("p") == []
    residency.apply("a", tuple(stored_chunks(PREFIX, 60)))  # computed again
    assert residency.resident("p") == ["a"]


def test_cleared_reset_and_unknown_pods_hold_nothing() -> None:
    residency = residency_with_prefix()
    for pod in ("a", "b"):
        residency.apply(pod, tuple(stored_chunks(PREFIX, 1)))
    residency.apply("a", (AllBlocksCleared(),))
    residency.reset("b", known=False)
    residency.apply("b", tuple(stored_chunks(PREFIX, 1)))  # unknown: not taken as the truth
    assert residency.resident("p") == []


def test_other_traffic_is_kept_only_for_its_latest_blocks() -> None:
    residency = residency_with_prefix()
    residency.apply("a", tuple(stored_chunks(PREFIX, 1)))
    other = list(range(500, 500 + (RECENT_BLOCKS + 10) * BLOCK))
    residency.apply("a", tuple(stored_chunks(other, 1000, per_event=64)))
    engine = residency._engine["a"]
    assert len(engine) == RECENT_BLOCKS + 2 and {1, 2} <= engine.keys()  # the prefix's stay
    assert residency.resident("p") == ["a"]


def test_a_prefix_whose_ids_come_after_its_blocks_is_resident() -> None:
    """Its prewarm was stored before /tokenize answered: the recent blocks tell."""
    residency = Residency()
    residency.reset("a", known=True)
    residency.apply("a", tuple(stored_chunks(PREFIX, 1)))
    residency.watch_prefix("p", PREFIX)
    assert residency.resident("p") == ["a"]


def test_a_lora_or_a_salt_is_a_different_prefix() -> None:
    residency = residency_with_prefix()
    lora = [
        BlockStored((1, 2), None, tuple(PREFIX[:8]), BLOCK, lora_name="adapter"),
    ]
    salted = [
        BlockStored((3, 4), None, tuple(PREFIX[:8]), BLOCK, extra_keys=(("salt",), None)),
    ]
    residency.apply("a", tuple(lora))
    residency.apply("b", tuple(salted))
    assert residency.resident("p") == []
    residency.watch_prefix("q", PREFIX, lora_name="adapter")
    residency.apply("a", tuple(lora))
    assert residency.resident("q") == ["a"]


def test_a_prefix_registered_later_and_forgotten() -> None:
    residency = Residency()
    residency.reset("a", known=True)
    residency.apply("a", tuple(stored_chunks(list(range(8)), 1)))  # the block size is learnt
    residency.watch_prefix("p", PREFIX)
    residency.apply("a", tuple(stored_chunks(PREFIX, 10)))
    assert residency.resident("p") == ["a"]
    residency.forget_prefix("p")
    assert residency.resident("p") == []


def test_a_pod_followed_from_some_point_says_only_what_it_heard() -> None:
    """`resume`: its history is gone (a long-running pod's replay buffer, a gap). What it
    stores from then on is true; a prefix it never stored since may still be there, unless
    a block of it was heard removed; a clear makes it whole again."""
    residency = Residency()
    residency.watch_prefix("p", PREFIX)
    residency.watch_prefix("q", [t + 1000 for t in PREFIX])
    residency.resume("a")
    assert residency.holds("a", "p") is None and residency.known("a")
    residency.apply("a", tuple(stored_chunks(PREFIX, 10)))
    assert residency.holds("a", "p") is True and residency.holds("a", "q") is None
    residency.apply("a", (BlockRemoved((11,)),))
    assert residency.holds("a", "p") is False  # heard stored, then heard removed
    residency.apply("a", tuple(stored_chunks(PREFIX, 20)))
    assert residency.holds("a", "p") is True
    residency.apply("a", (AllBlocksCleared(),))
    assert residency.holds("a", "q") is False  # empty, and known whole


def test_a_pods_capacity_is_the_most_it_held_and_outlives_its_restarts() -> None:
    """vLLM evicts only when full: the peak of stored less removed is about its capacity."""
    residency = residency_with_prefix()
    residency.apply("a", tuple(stored_chunks(list(range(20)), 1)))  # 5 blocks
    residency.apply("a", tuple(stored_chunks(list(range(20)), 1)))  # the same again: no more
    residency.apply("a", (BlockRemoved((1, 2, 3)),))
    residency.apply("a", tuple(stored_chunks(PREFIX, 10)))  # 2 blocks: 4 held
    assert residency.capacity("a") == 5 and residency.capacity("b") == 0
    residency.reset("a", known=True)  # restarted: empty, the same pod
    residency.apply("a", (AllBlocksCleared(),))
    assert residency.capacity("a") == 5
    residency.keep_pods(["b"])  # no longer followed: all of it goes
    assert residency.capacity("a") == 0 and not residency.known("a") and residency.known("b")


def test_a_footprint_counts_a_shared_head_once() -> None:
    residency = residency_with_prefix()
    residency.watch_prefix("q", [*PREFIX[:BLOCK], *range(500, 508)])  # p's first block, 2 more
    assert residency.footprint("a", ["p", "q"]) == 0  # the pod's block size is not known yet
    residency.apply("a", tuple(stored_chunks(PREFIX, 10)))
    assert residency.footprint("a", ["p"]) == 2 and residency.footprint("a", ["q"]) == 3
    assert residency.footprint("a", ["p", "q"]) == 4


def test_only_the_pods_own_cache_counts_not_an_offloaded_copy() -> None:
    """An offloading pod copies a block to the CPU tier (same hash), then evicts it from its
    GPU: the prefix is gone from what a request reuses at once, and a copy stored or dropped
    in the CPU tier alone changes nothing."""
    residency = residency_with_prefix()
    residency.apply("a", tuple(stored_chunks(PREFIX, 50, medium="GPU")))
    residency.apply("a", tuple(stored_chunks(PREFIX, 50, medium="CPU")))  # offloaded
    residency.apply("b", tuple(stored_chunks(PREFIX, 50, medium="CPU")))  # a CPU copy only
    assert residency.resident("p") == ["a"]
    assert residency.capacity("a") == 2
    residency.apply("a", (BlockRemoved((50, 51), medium="CPU"),))  # the copy dropped
    assert residency.resident("p") == ["a"]
    residency.apply("a", (BlockRemoved((51,), medium="GPU"),))  # evicted from the GPU
    assert residency.resident("p") == []
    residency.apply("a", tuple(stored_chunks(PREFIX, 50, medium="gpu")))  # any case
    assert residency.resident("p") == ["a"] and residency.capacity("a") == 2
