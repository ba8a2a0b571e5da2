"""A deterministic approximate tokenizer: every 4 UTF-8 bytes are one token.

Real tokenizers average ~4 bytes per token on English text, so counts land near vLLM's.
The hot path (every request of a benchmark, prompts up to 240 KB) never builds the token
list: the count is arithmetic and the prefix-cache block hashes are taken over whole
slices of 4 x block-size bytes (64 bytes at 16 tokens), in one C call (the routing core's
chained block keys): a 60k-token prompt costs ~0.15 ms, where a Python loop of BLAKE2b
took ~2.8 ms, most of the emulator's CPU per request.

Token id of a piece = (little-endian uint32 of the piece, zero-padded) * 2654435761
(Knuth's multiplicative hash) mod 2**32 mod vocab_size: stable across runs and machines.
"""

from __future__ import annotations

import sys
from array import array

from prefix_sidecar import _core
from prefix_sidecar_tools.emulator.config import BLOCK_SIZE

BYTES_PER_TOKEN = 4


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


def block_hashes(data: bytes, block_size: int = BLOCK_SIZE) -> list[int]:
    """Chained hashes of the FULL `block_size`-token blocks of `data`, like vLLM's prefix
    cache.

    hash_i = key(hash_{i-1}, block_i bytes) (`_core.chain_keys`, 64-bit): a block's
    identity depends on everything before it, so two prompts share block i only if they
    share blocks 0..i. A trailing partial block has no hash (vLLM caches full blocks only);
    a block whose last token is a partial 4-byte piece is full, its piece zero-padded as
    `token_ids` pads it.
    """
    block_bytes = block_size * BYTES_PER_TOKEN
    full_blocks = count_tokens(data) // block_size
    short = full_blocks * block_bytes - len(data)
    if short > 0:
        data = data + b"\x00" * short
    return _core.chain_keys(data, block_bytes, full_blocks)
