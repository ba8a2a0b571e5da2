"""Does the prefix+query join cost a KV block? (issue 28, the tokenization boundary.)

The sidecar prewarms a prefix by sending its text alone, and serves a query by sending the
prefix text with the query text appended. A BPE tokenizer may tokenize the end of the
prefix differently once text follows it, and then the last tokens of the prefix differ
between the two prompts. The prefix cache holds whole blocks only, so this costs a block
exactly when a changed token falls in a whole block: `floor(P / B) x B` tokens (P the
prefix's tokens, B the block size) is all a query can be served from the cache, and less
is the join's cost.

Each case here does what the sidecar does, straight to one pod: a max_tokens=1 completion
of the prefix (the prewarm), then one of prefix + query; it reads the pod's cached_tokens
and its /tokenize of both prompts. Each case is prewarmed both ways of WARMS: with the text
as registered (what the sidecar sends), and with its trailing whitespace stripped (the
candidate fix), and compared with `kept`, the whole blocks of the prefix without its
trailing whitespace: the blocks every query that starts with whitespace shares.

Joins: how the prefix ends, how the query starts. Each join runs on a prefix of a natural
length and on one cut so that P is a multiple of B, the case where the prefix's last token
closes a whole block (at a natural length a change at the very end falls in the partial
tail block, which is never cached anyway). `join_rates` then
counts, over many prefixes and with /tokenize alone, how often each join changes the
prefix's last tokens and by how many: the odds that it costs a block.

    python -m prefix_sidecar_tools.vllm.boundary --url http://127.0.0.1:PORT

(the URL of a pod of `prefix-sidecar vllm-fleet`). Columns: `prefix` and `kept` are token
counts of the prefix and of the prefix without its trailing whitespace; `shared` the
leading tokens the prewarm's prompt and the query's share; `floor` and `kept` (the second)
their whole blocks; `lost` the blocks short of `floor`; `short` the blocks short of `kept`,
which a better prewarm could have saved. What was found is in docs/vllm.md.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

import aiohttp

from prefix_sidecar_tools.vllm.fleet import SERVED_MODEL
from prefix_sidecar_tools.vllm.reports import (
    cache_counters,
    cached_tokens,
    common_length,
    complete,
    tokenize,
    whole_blocks,
)
from prefix_sidecar_tools.vllm.tiny_model import document

QUESTION = "Question: which clause applies to a coupon order?"
# name -> (what the prefix ends with, the query); the prefix's own text ends mid-sentence.
JOINS: dict[str, tuple[str, str]] = {
    "full stop | space": (".", " " + QUESTION),
    "full stop | newline": (".", "\n" + QUESTION),
    "word | space": ("", " " + QUESTION),
    "word | letters": ("", "s, " + QUESTION),
    "space | word": (" ", QUESTION),
    "newline | newline": ("\n", "\n" + QUESTION),
}
NATURAL_WORDS = 1800
SOURCE_WORDS = 2600  # a block-aligned cut is searched from 1,800 tokens up


# How a case prewarms its prefix: with the text as registered (what the sidecar sends), or
# with its trailing whitespace stripped (the candidate fix of issue 28, measured here).
WARMS = ("text", "stripped")


def warm_text(prefix: str, warm: str) -> str:
    return prefix.rstrip() if warm == "stripped" else prefix


@dataclass(frozen=True)
class JoinCase:
    """One prewarm + query pair, as the pod reported it."""

    join: str
    aligned: bool  # the prefix's token count is a multiple of the block size
    warm: str  # one of WARMS
    prefix_tokens: int
    # the prefix without its trailing whitespace: tokens that every query starting with
    # whitespace shares, whatever its first word (the whitespace may merge into that word)
    kept_tokens: int
    block_size: int
    shared_tokens: int  # leading tokens the prewarm's prompt and prefix + query share
    cached: int  # cached_tokens of the query, from the pod's usage

    @property
    def whole_blocks(self) -> int:
        """floor(prefix tokens / block size) x block size: the prefix's whole blocks."""
        return whole_blocks(self.prefix_tokens, self.block_size)

    @property
    def kept_blocks(self) -> int:
        """The whole blocks of the prefix without its trailing whitespace: what no prewarm
        of text can fail to serve, and all it can promise when the query is unknown."""
        return whole_blocks(self.kept_tokens, self.block_size)

    @property
    def blocks_lost(self) -> int:
        """Blocks short of the prefix's whole blocks."""
        return (self.whole_blocks - self.cached) // self.block_size

    @property
    def blocks_short(self) -> int:
        """Blocks short of `kept_blocks`: what the join costs that a prewarm could save."""
        return max(0, self.kept_blocks - self.cached) // self.block_size

    def row(self) -> str:
        return (
            f"{self.join:<20} {'yes' if self.aligned else 'no':<8}{self.warm:<9}"
            f"{self.prefix_tokens:>7} {self.kept_tokens:>5} {self.shared_tokens:>7} "
            f"{self.whole_blocks:>6} {self.kept_blocks:>5} {self.cached:>7} "
            f"{self.blocks_lost:>5} {self.blocks_short:>6}"
        )


HEADER = (
    f"{'join (prefix | query)':<20} {'aligned':<8}{'prewarm':<9}{'prefix':>7} {'kept':>5} "
    f"{'shared':>7} {'floor':>6} {'kept':>5} {'cached':>7} {'lost':>5} {'short':>6}"
)


class Pod:
    """One vLLM pod, read directly: its tokenizer, its completions."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str) -> None:
        self.session = session
        self.url = url
        self.model = model

    async def count(self, text: str) -> int:
        return len(await tokenize(self.session, self.url, self.model, text))

    async def aligned_words(
        self, words: list[str], ending: str, block: int, at_least: int
    ) -> int | None:
        """The fewest leading words whose prefix (see `prefix_of`) is a whole number of
        blocks, at least `at_least` tokens, found by bisection (the count only grows as
        words are added); None if no cut hits one."""
        top = await self.count(prefix_of(words, len(words), ending))
        for target in range(-(-at_least // block) * block, top + 1, block):
            low, high = 1, len(words)
            while low < high:
                middle = (low + high) // 2
                if await self.count(prefix_of(words, middle, ending)) < target:
                    low = middle + 1
                else:
                    high = middle
            if await self.count(prefix_of(words, low, ending)) == target:
                return low
        return None

    async def measure(
        self, join: str, prefix: str, query: str, aligned: bool, warm: str
    ) -> JoinCase:
        block = (await cache_counters(self.session, self.url)).block_size
        warmed = warm_text(prefix, warm)
        warmed_ids = await tokenize(self.session, self.url, self.model, warmed)
        joined = await tokenize(self.session, self.url, self.model, prefix + query)
        await complete(self.session, self.url, self.model, warmed)  # the prewarm
        answer = await complete(self.session, self.url, self.model, prefix + query)
        return JoinCase(
            join=join,
            aligned=aligned,
            warm=warm,
            prefix_tokens=await self.count(prefix),
            kept_tokens=await self.count(prefix.rstrip()),
            block_size=block,
            shared_tokens=common_length(warmed_ids, joined),
            cached=cached_tokens(answer["usage"]),
        )


async def measure_joins(
    session: aiohttp.ClientSession, url: str, model: str = SERVED_MODEL, key: str = "boundary"
) -> list[JoinCase]:
    """Every join of JOINS at a natural prefix length and at a block-aligned one, each
    prewarmed both ways of WARMS. Each case has its own text (`key`, the join, the length
    and the prewarm in the document key), so no case hits another's cache; pass a new `key`
    to measure again on the same pod."""
    pod = Pod(session, url, model)
    block = (await cache_counters(session, url)).block_size
    cases: list[JoinCase] = []
    for number, (join, (ending, query)) in enumerate(JOINS.items()):
        for warm in WARMS:
            words = document(f"{key}-{number}-{warm}-natural", NATURAL_WORDS).split(" ")
            natural = prefix_of(words, len(words), ending)
            cases.append(await pod.measure(join, natural, query, aligned=False, warm=warm))
            words = document(f"{key}-{number}-{warm}-aligned", SOURCE_WORDS).split(" ")
            cut = await pod.aligned_words(words, ending, block, at_least=NATURAL_WORDS)
            if cut is not None:
                aligned = prefix_of(words, cut, ending)
                cases.append(await pod.measure(join, aligned, query, aligned=True, warm=warm))
    return cases


def prefix_of(words: list[str], count: int, ending: str) -> str:
    """The first `count` words without their trailing punctuation, then `ending`: the
    prefix's last characters are the join's, whatever word the cut falls on."""
    return " ".join(words[:count]).rstrip(".,") + ending


@dataclass(frozen=True)
class JoinRate:
    """Over many prefixes of one join: how often, and by how many tokens, the prefix's own
    tokenization differs from the start of prefix + query (/tokenize only, no completion)."""

    join: str
    samples: int
    changed: int  # prefixes whose last tokens differ once the query follows
    mean_changed_tokens: float  # over those, prefix tokens not shared with prefix + query

    def row(self) -> str:
        return (
            f"{self.join:<20} {self.samples:>7} {self.changed:>7} {self.mean_changed_tokens:>13.2f}"
        )


RATE_HEADER = f"{'join (prefix | query)':<20} {'samples':>7} {'changed':>7} {'mean tokens':>13}"
RATE_WORDS = 60  # only the tail of a prefix can change: short prefixes measure the same


async def join_rates(
    session: aiohttp.ClientSession, url: str, model: str = SERVED_MODEL, samples: int = 100
) -> list[JoinRate]:
    """Each join of JOINS over `samples` different prefixes. A changed prefix loses a block
    when its changed tokens reach into its last whole block: with C changed tokens, for
    about C of every B prefix lengths."""
    rates = []
    for join, (ending, query) in JOINS.items():
        lost: list[int] = []
        for sample in range(samples):
            words = document(f"rate-{sample}", RATE_WORDS).split(" ")
            prefix = prefix_of(words, len(words), ending)
            alone = await tokenize(session, url, model, prefix)
            joined = await tokenize(session, url, model, prefix + query)
            if (missing := len(alone) - common_length(alone, joined)) > 0:
                lost.append(missing)
        mean = sum(lost) / len(lost) if lost else 0.0
        rates.append(JoinRate(join, samples, len(lost), mean))
    return rates


async def _main(url: str, model: str, key: str) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        cases = await measure_joins(session, url, model, key)
        rates = await join_rates(session, url, model)
    print(HEADER)
    for case in cases:
        print(case.row())
    print("\n" + RATE_HEADER)
    for rate in rates:
        print(rate.row())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="a vLLM pod, http://127.0.0.1:PORT")
    parser.add_argument("--model", default=SERVED_MODEL, help="its served model name")
    parser.add_argument("--key", default="boundary", help="new texts for a new run")
    args = parser.parse_args()
    asyncio.run(_main(args.url, args.model, args.key))
