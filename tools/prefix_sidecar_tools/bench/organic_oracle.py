"""The oracle ceiling of `bench organic`: the best prefix-token hit rate any router could get.

One infinite cache sees every request of the trace in nominal order. A request's ceiling is
what that cache would serve it: the emulator's own rule (prefix_sidecar_tools/emulator: chained
16-token block hashes, leading blocks only, the last prompt token always recomputed), read
from the emulator's PrefixCache and tokenizer, not re-implemented here. A real pod has a
finite cache and a router splits the traffic, so a measured hit rate sits at or below it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefix_sidecar_tools.emulator.config import BLOCK_SIZE
from prefix_sidecar_tools.emulator.prefix_cache import PrefixCache
from prefix_sidecar_tools.emulator.tokenizer import block_hashes, count_tokens


@dataclass(frozen=True)
class Ceiling:
    prompt_tokens: int
    cached_tokens: int  # what the infinite cache serves


def oracle(prompts: Sequence[str]) -> list[Ceiling]:
    """Per-prompt ceilings, `prompts` in the order an ideal cache would see them."""
    chains = [block_hashes(p.encode("utf-8")) for p in prompts]
    cache = PrefixCache(max(1, sum(len(chain) for chain in chains)))  # never evicts
    ceilings: list[Ceiling] = []
    for prompt, chain in zip(prompts, chains, strict=True):
        tokens = count_tokens(prompt.encode("utf-8"))
        hits = cache.hit_blocks(chain, tokens)
        cache.allocate(chain)
        cache.release(chain)
        ceilings.append(Ceiling(tokens, hits * BLOCK_SIZE))
    return ceilings


def hit_rate(ceilings: Sequence[Ceiling]) -> float:
    total = sum(c.prompt_tokens for c in ceilings)
    return sum(c.cached_tokens for c in ceilings) / total if total else 0.0
