"""A deterministic approximate tokenizer: every 4 UTF-8 bytes are one token.

Real tokenizers average ~4 bytes per token on English text, so counts land near vLLM's.
The hot path (every request of a benchmark, prompts up to 240 KB) never builds the token
list: the count is arithmetic and the prefix-cache block hashes are taken over whole
64-byte slices (16 tokens), so a 60k-token prompt costs ~4k hash calls, not 60k.

Token id of a piece = (little-endian uint32 of the piece, zero-padded) * 2654435761
(Knuth's multiplicative hash) mod 2**32 mod vocab_size: stable across runs and machines.
"""

from __future__ import annotations

import hashlib
import sys
from array import array

from sidecar.tools.emulator.config import BLOCK_SIZE

BYTES_PER_TOKEN = 4
BLOCK_BYTES = BLOCK_SIZE * BYTES_PER_TOKEN
ROOT_HASH = b"\x00" * 16  # the parent of a prompt's first block


def count_tokens(data: bytes) -> int:
    """Tokens in `data`: one per started 4-byte piece."""
    return -(-len(data) // BYTES_PER_TOKEN)


def token_ids(data: bytes, vocab_size: int) -> list[int]:
    """The token ids of `data` (for /tokenize; the serving path only needs counts)."""
    padded = data + b"\x00" * (-len(data) % BYTES_PER_TOKEN)
    words = array("I")
    if words.itemsize != BYTES_PER_TOKEN:  # pragma: no cover - exotic platforms only
        words = array("L")
    words.frombytes(padded)
    if sys.byteorder == "big":  # pragma: no cover
        words.byteswap()
    return [(w * 2654435761 & 0xFFFFFFFF) % vocab_size for w in words]


def block_hashes(data: bytes) -> list[bytes]:
    """Chained hashes of the FULL 16-token blocks of `data`, like vLLM's prefix cache.

    hash_i = BLAKE2b(key=hash_{i-1}, block_i bytes): a block's identity depends on
    everything before it, so two prompts share block i only if they share blocks 0..i.
    A trailing partial block has no hash (vLLM caches full blocks only).
    """
    full_blocks = count_tokens(data) // BLOCK_SIZE
    hashes: list[bytes] = []
    parent = ROOT_HASH
    view = memoryview(data)
    blake2b = hashlib.blake2b
    for start in range(0, full_blocks * BLOCK_BYTES, BLOCK_BYTES):
        parent = blake2b(view[start : start + BLOCK_BYTES], key=parent, digest_size=16).digest()
        hashes.append(parent)
    return hashes
