"""Our block keys (kv_events/block_keys.py): a chain made in one C pass is the same as the
keys made block by block from the events, and a key's value is fixed (the shared index holds
them across sidecar and indexer versions: a change must be deliberate)."""

from __future__ import annotations

import pytest

from prefix_sidecar.kv_events.block_keys import (
    KEY_BYTES,
    PromptKeys,
    block_key,
    chain,
    key_bytes,
    root_key,
)

TOKENS = [(n * 7919) % 50_000 for n in range(1000)]


@pytest.mark.parametrize(("size", "lora"), [(16, None), (16, "adapter-a"), (128, None), (1, "b")])
def test_a_chain_is_its_blocks_keyed_one_by_one(size: int, lora: str | None) -> None:
    keys = chain(TOKENS, size, lora)
    assert len(keys) == len(TOKENS) // size
    parent = root_key(lora, size)
    for index, key in enumerate(keys):
        parent = block_key(parent, TOKENS[index * size : (index + 1) * size])
        assert key == parent and 0 <= key < 1 << (8 * KEY_BYTES)


def test_keys_differ_by_adapter_and_block_size_and_are_pinned() -> None:
    assert chain(TOKENS, 16)[0] != chain(TOKENS, 16, "adapter-a")[0]
    assert chain(TOKENS, 16)[0] != chain(TOKENS[:32], 32)[0]
    assert key_bytes(chain(list(range(100)), 16, "x")[:1]).hex() == "ddce0905ec37d8f3"
    assert chain(TOKENS[:15], 16) == []


def test_a_prompts_chains_are_made_once_per_block_size() -> None:
    prompt = PromptKeys(TOKENS)
    assert prompt.at(16) is prompt.at(16) and prompt.at(16) == chain(TOKENS, 16)
    assert prompt.at(128) == chain(TOKENS, 128)
