"""Tokenizer and prefix-cache unit tests: block chaining, the last-token rule, LRU, pins."""

from __future__ import annotations

import time

import pytest

from prefix_sidecar_tools.emulator.prefix_cache import PrefixCache
from prefix_sidecar_tools.emulator.tokenizer import block_hashes, count_tokens, token_ids


def test_count_is_one_token_per_started_4_bytes() -> None:
    assert [count_tokens(b"x" * n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert count_tokens("ü".encode()) == 1  # 2 UTF-8 bytes


def test_token_ids_are_stable_and_in_vocab() -> None:
    ids = token_ids(b"abcdabcdxyz", 1000)
    assert len(ids) == 3
    assert ids[0] == ids[1] != ids[2]
    assert all(0 <= i < 1000 for i in ids)
    assert ids == token_ids(b"abcdabcdxyz", 1000)
    assert ids[0] == (int.from_bytes(b"abcd", "little") * 2654435761 & 0xFFFFFFFF) % 1000


def test_block_hashes_are_chained_and_full_blocks_only() -> None:
    a = b"A" * 64 + b"B" * 64 + b"C" * 10  # 2 full blocks + a partial one
    b = b"A" * 64 + b"X" * 64 + b"C" * 64
    c = b"Z" * 64 + b"B" * 64
    ha, hb, hc = block_hashes(a), block_hashes(b), block_hashes(c)
    assert len(ha) == 2 and len(hb) == 3
    assert ha[0] == hb[0] and ha[1] != hb[1]
    assert hc[1] != ha[1]  # same block bytes, different parent -> different hash
    # a block of 16 tokens whose last token is partial is still a full block
    assert len(block_hashes(b"q" * 61)) == 1


def test_tokenizer_is_fast_for_a_240kb_prompt() -> None:
    data = b"compliance rules " * 14_200  # ~240 KB, ~60k tokens
    start = time.perf_counter()
    for _ in range(10):
        block_hashes(data)
        count_tokens(data)
    per_call = (time.perf_counter() - start) / 10
    assert per_call < 0.02, f"{per_call * 1000:.1f} ms per 60k-token prompt"


def hashes_for(n_blocks: int, tag: bytes = b"p") -> list[int]:
    return block_hashes(tag * (64 * n_blocks))


def test_hits_are_leading_blocks_and_never_the_whole_prompt() -> None:
    cache = PrefixCache(100)
    hashes = hashes_for(4)
    assert cache.hit_blocks(hashes, 64) == 0
    cache.allocate(hashes)
    cache.release(hashes)
    assert cache.hit_blocks(hashes, 64) == 3  # exactly 4 blocks: the last is recomputed
    assert cache.hit_blocks(hashes, 65) == 4  # one more token: all 4 full blocks hit
    longer = block_hashes(b"p" * 64 * 4 + b"q" * 64 * 2)
    assert cache.hit_blocks(longer, 96) == 4


def test_lru_eviction_evicts_least_recent_and_tails_first() -> None:
    cache = PrefixCache(6)
    old, new = hashes_for(3, b"o"), hashes_for(3, b"n")
    for h in (old, new):
        cache.allocate(h)
        cache.release(h)
    assert cache.cached_blocks == 6
    third = hashes_for(2, b"t")
    cache.allocate(third)  # evicts 2 blocks of `old`, its tail first
    assert cache.counters.evicted_blocks == 2
    assert cache.contains(old[0]) and not cache.contains(old[1]) and not cache.contains(old[2])
    assert all(cache.contains(h) for h in new)
    assert cache.hit_blocks(old, 48 + 1) == 1


def test_pinned_blocks_are_never_evicted() -> None:
    cache = PrefixCache(4)
    running = hashes_for(3, b"r")
    cache.allocate(running)
    other = hashes_for(2, b"o")
    assert not cache.can_allocate(other)  # 3 pinned + 2 new > 4
    with pytest.raises(RuntimeError):
        cache.allocate(other)
    cache.release(running)
    assert cache.can_allocate(other)
    cache.allocate(other)
    assert cache.pinned_blocks == 2 and cache.cached_blocks == 4


def test_shared_blocks_are_refcounted() -> None:
    cache = PrefixCache(10)
    shared = hashes_for(2)
    cache.allocate(shared)
    cache.allocate(shared)
    cache.release(shared)
    assert cache.pinned_blocks == 2
    cache.release(shared)
    assert cache.pinned_blocks == 0 and cache.cached_blocks == 2


def test_reset_drops_unpinned_only() -> None:
    cache = PrefixCache(10)
    a, b = hashes_for(2, b"a"), hashes_for(2, b"b")
    cache.allocate(a)
    cache.allocate(b)
    cache.release(b)
    assert sorted(cache.reset()) == sorted(b)
    assert cache.cached_blocks == 2 and cache.contains(a[0]) and not cache.contains(b[0])


def test_allocate_says_what_it_evicted_and_inserted() -> None:
    """What the pod's KV events carry: the LRU blocks evicted, then the indexes inserted."""
    cache = PrefixCache(4)
    a, b = hashes_for(3, b"a"), hashes_for(3, b"b")
    assert cache.allocate(a) == ([], [0, 1, 2])
    cache.release(a)  # a's tail goes first
    assert cache.allocate(b) == ([a[2], a[1]], [0, 1, 2])
    cache.release(b)
    assert cache.allocate(a) == ([b[2], b[1]], [1, 2])  # a[0] still held: a hit
