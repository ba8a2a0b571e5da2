"""Our own chained key per KV block, from the token ids the pods' BlockStored events carry.

key(i) = 64-bit MurmurHash3 (`_core.route_key`) of key(i-1) and the block's token ids, 8 bytes
each, chained in C (`_core.chain_keys`); the first block's parent is a root of the LoRA name,
the cache salt and the block size, as vLLM hashes the name into every block and the salt into
the first. The engine's own hashes follow --prefix-caching-hash-algo (sha256 over pickle by
default: not reproducible here), so each stored block's engine hash maps to our key, which a
BlockRemoved (hashes only) then finds. Not cryptographic: keying is most of a precise
decision's CPU, and a key only steers routing, so a crafted collision costs a cache miss,
never content (the pod's own hash decides reuse); 64 bits: ~8 million fleet blocks collide
by accident at odds of ~2e-6 (docs/kv-events.md).
"""

from __future__ import annotations

import functools
import hashlib
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence

from prefix_sidecar import _core
from prefix_sidecar.kv_events.decode import BlockStored
from prefix_sidecar.routing.scope import Scope, scope_bytes

KEY_BYTES = 8  # a key is a uint64; in the shared index, its 8 little-endian bytes in hex
TOKEN_BYTES = 8  # each id as a uint64: pods' vocabularies fit, and ids are checked < 2**32


def key_bytes(values: Sequence[int]) -> bytes:
    """`values` as little-endian 8-byte words, run together: token ids, and keys as
    chain_keys reads a parent and the shared index names a block."""
    words = array("Q", values)
    if sys.byteorder == "big":  # pragma: no cover - exotic platforms only
        words.byteswap()
    return words.tobytes()


# Roots cached, each <= 1 MB (one is made only for a block size an event fills, and a payload
# holds <= 128 Ki token ids: decode.py): a hostile publisher pins at most this many.
ROOTS_KEPT = 16


@functools.lru_cache(maxsize=ROOTS_KEPT)
def _root_block(lora_name: str | None, width: int, salt: str | None = None) -> bytes:
    """The `width`-byte first block a chain starts from, made of the LoRA name and the cache
    salt (an unsalted root of the name alone)."""
    if salt:
        scope = b"root-salted\0" + scope_bytes(Scope(lora_name or "", salt))
    else:
        scope = b"root\0" + (lora_name or "").encode()
    seed = hashlib.blake2b(scope, digest_size=16).digest()
    return (seed * (width // len(seed) + 1))[:width]


def root_key(lora_name: str | None, block_size: int, salt: str | None = None) -> int:
    """The parent of a chain's first block."""
    return _core.route_key(bytes(8) + _root_block(lora_name, block_size * TOKEN_BYTES, salt))


def block_key(parent: int, tokens: Sequence[int]) -> int:
    return _core.route_key(key_bytes([parent, *tokens]))


def chain(
    tokens: Sequence[int], block_size: int, lora_name: str | None = None, salt: str | None = None
) -> list[int]:
    """The keys of `tokens`' whole blocks, in order, as block_key makes them, in one C pass.
    Ints, not bytes: 65 against 118 us for a 4,096-token prompt's chain and index query."""
    width, count = block_size * TOKEN_BYTES, len(tokens) // block_size
    if count == 0:
        return []
    data = _root_block(lora_name, width, salt) + key_bytes(tokens[: count * block_size])
    return _core.chain_keys(data, width, count + 1)[1:]  # the root's key first


class PromptKeys:
    """A prompt's chain at each block size asked for, made once: a precise decision reads
    it three times (what this sidecar just sent, the fleet's blocks, then its own credit)."""

    def __init__(
        self, tokens: Sequence[int], lora_name: str | None = None, salt: str | None = None
    ) -> None:
        self.tokens, self.lora_name, self.salt = tokens, lora_name, salt
        self._chains: dict[int, list[int]] = {}

    def at(self, block_size: int) -> list[int]:
        keys = self._chains.get(block_size)
        if keys is None:
            keys = chain(self.tokens, block_size, self.lora_name, self.salt)
            self._chains[block_size] = keys
        return keys


def _beyond_lora(event: BlockStored, index: int) -> tuple[object, ...]:
    """What block `index` was hashed with besides its tokens and its LoRA name: vLLM's extra
    keys are the name, then media hashes, then the cache salt on a prompt's first block."""
    extra = event.extra_keys[index] if event.extra_keys and index < len(event.extra_keys) else None
    items = tuple(extra or ())
    if event.lora_name is not None and items[:1] == (event.lora_name,):
        items = items[1:]
    return items


def _first_salt(event: BlockStored) -> tuple[bool, str | None]:
    """(keyable, salt) of a prompt's first block: one string past the LoRA name is its cache
    salt; more (media) and no prompt's token ids alone give its key."""
    items = _beyond_lora(event, 0)
    if not items:
        return True, None
    if len(items) == 1 and isinstance(items[0], str):
        return True, items[0]
    return False, None


def stored_keys(
    event: BlockStored, key_of: Callable[[int], int | None]
) -> Iterator[tuple[int, int]]:
    """(engine hash, our key) of each block `event` stored, in order, while they can be
    keyed: a parent we never keyed (`key_of` maps the pod's hashes to ours), a short block
    or one hashed with more than its LoRA name (and, on a prompt's first block, its salt)
    ends the run."""
    size, parent = event.block_size, event.parent_block_hash
    if len(event.token_ids) < size:
        return  # no whole block to key: no root is made for a block size nothing fills
    first = parent is None
    if parent is None:
        keyable, salt = _first_salt(event)
        key: int | None = root_key(event.lora_name, size, salt) if keyable else None
    else:
        key = key_of(parent)
    for index, engine_hash in enumerate(event.block_hashes):
        tokens = event.token_ids[index * size : (index + 1) * size]
        if key is None or len(tokens) != size:
            return
        if not (first and index == 0) and _beyond_lora(event, index):
            return
        key = block_key(key, tokens)
        yield engine_hash, key
