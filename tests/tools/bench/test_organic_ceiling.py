"""`bench real`'s organic ceiling: one infinite cache of whole blocks over the prompts."""

from __future__ import annotations

from prefix_sidecar_tools.bench.real_megasale import organic_ceiling

BLOCK = 4


def test_a_prompt_is_served_the_leading_blocks_seen_before() -> None:
    first = list(range(10))  # 2 whole blocks and a tail
    again = [*first[:8], 99, 98, 97, 96, 95]  # its 2 blocks, then new ones
    other = [7, *first]  # shifted: no leading block shared
    found = organic_ceiling([first, again, other], BLOCK)
    assert found.prompt_tokens == 10 + 13 + 11
    assert found.cached_tokens == 8
    assert found.hit_rate == 8 / 34


def test_a_prompt_wholly_cached_recomputes_its_last_token() -> None:
    prompt = list(range(8))  # exactly 2 blocks
    assert organic_ceiling([prompt, prompt], BLOCK).cached_tokens == 4
