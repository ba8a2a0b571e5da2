"""Our own key per KV block, chained, from the token ids the pods' BlockStored events carry.

key(i) = blake2b(key(i-1) + the block's token ids), the first block's parent a root made of
the LoRA name, as vLLM folds it into its own hash. Not the engine's hashes: those depend on
the pod's --prefix-caching-hash-algo (sha256 over pickle by default: not reproducible outside
vLLM's Python, and two pods set differently never agree), while the token ids are what the
pod cached. As llm-d does, each stored block's engine hash is mapped to our key, so a
BlockRemoved (hashes only) finds it. A block is ~2 us to key (128 tokens).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterator, Sequence

from prefix_sidecar.kv_events.decode import BlockStored

KEY_BYTES = 16


def root_key(lora_name: str | None) -> bytes:
    return hashlib.blake2b(b"root\0" + (lora_name or "").encode(), digest_size=KEY_BYTES).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("Q", tokens).tobytes(), digest_size=KEY_BYTES).digest()


def chain(tokens: Sequence[int], block_size: int, lora_name: str | None = None) -> list[bytes]:
    """The keys of `tokens`' whole blocks, in order (block_key's, from the ids made one
    buffer once: a quarter faster than an array a block)."""
    width = 8 * block_size
    data = array("Q", tokens[: len(tokens) // block_size * block_size]).tobytes()
    keys, key, blake2b = [], root_key(lora_name), hashlib.blake2b
    for start in range(0, len(data), width):
        key = blake2b(key + data[start : start + width], digest_size=KEY_BYTES).digest()
        keys.append(key)
    return keys


class PromptKeys:
    """A prompt's chain at each block size asked for, made once: a precise decision reads
    it three times (what this sidecar just sent, the fleet's blocks, then its own credit),
    and keying is most of the decision's CPU (~0.25 ms for 256 blocks of 16 tokens)."""

    def __init__(self, tokens: Sequence[int], lora_name: str | None = None) -> None:
        self.tokens, self.lora_name = tokens, lora_name
        self._chains: dict[int, list[bytes]] = {}

    def at(self, block_size: int) -> list[bytes]:
        keys = self._chains.get(block_size)
        if keys is None:
            keys = self._chains[block_size] = chain(self.tokens, block_size, self.lora_name)
        return keys


def _salted(event: BlockStored, index: int) -> bool:
    """Block `index` was hashed with more than its LoRA name (a cache_salt, media): no
    prompt's token ids alone give its key."""
    extra = event.extra_keys[index] if event.extra_keys and index < len(event.extra_keys) else None
    return bool(extra) and extra != (event.lora_name,)


def stored_keys(
    event: BlockStored, key_of: Callable[[int], bytes | None]
) -> Iterator[tuple[int, bytes]]:
    """(engine hash, our key) of each block `event` stored, in order, while they can be
    keyed: a parent we never keyed (`key_of` maps the pod's hashes to ours), a short block
    or a salted one ends the run."""
    size = event.block_size
    if event.parent_block_hash is None:
        key: bytes | None = root_key(event.lora_name)
    else:
        key = key_of(event.parent_block_hash)
    for index, engine_hash in enumerate(event.block_hashes):
        tokens = event.token_ids[index * size : (index + 1) * size]
        if key is None or len(tokens) != size or _salted(event, index):
            return
        key = block_key(key, tokens)
        yield engine_hash, key
