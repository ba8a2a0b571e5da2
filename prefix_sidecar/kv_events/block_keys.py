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


def root_key(lora_name: str | None) -> bytes:
    return hashlib.blake2b(b"root\0" + (lora_name or "").encode(), digest_size=16).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("Q", tokens).tobytes(), digest_size=16).digest()


def chain(tokens: Sequence[int], block_size: int, lora_name: str | None = None) -> list[bytes]:
    """The keys of `tokens`' whole blocks, in order."""
    keys, key = [], root_key(lora_name)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = block_key(key, tokens[start : start + block_size])
        keys.append(key)
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
