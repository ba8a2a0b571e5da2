"""Synthetic mega-sale texts: the fat prefixes and the thin merchant queries.

Deterministic for a seed, realistic-looking (numbered compliance articles, commission
tables per category, banned-word lists, live-stream script beats), ASCII only, and padded
to a whole number of 64-byte KV blocks (16 tokens at the emulator's 4 bytes per token), so
that a prefix's tokens are exactly its cacheable blocks and `cached_tokens` can be compared
with the prefix length without rounding noise.
"""

from __future__ import annotations

import random
from collections.abc import Callable

BYTES_PER_TOKEN = 4  # the emulator's tokenizer (docs/emulator.md)
BLOCK_BYTES = 64  # 16 tokens

CATEGORIES = (
    "womenswear",
    "menswear",
    "down jackets",
    "shoes",
    "beauty",
    "skincare",
    "mother and baby",
    "snacks",
    "fresh food",
    "home appliances",
    "phones",
    "laptops",
    "furniture",
    "sports",
    "pet supplies",
    "jewellery",
)
BANNED = (
    "lowest price ever",
    "number one in the world",
    "100% effective",
    "national level",
    "top grade",
    "cures",
    "zero risk",
    "last chance forever",
    "best on the whole web",
    "never seen before",
    "miracle",
    "guaranteed profit",
)
MECHANICS = (
    "cross-store discount of 50 off every 300",
    "2 items for 15% off",
    "second item half price",
    "platform coupon stacked with store coupon",
    "flash sale at 20:00 with limited stock",
    "pre-sale deposit of 20 that counts as 60",
    "gift with purchase over 199",
    "member points doubled",
    "free shipping and 7-day no-reason returns",
)
PRODUCTS = (
    "499 yuan down jacket",
    "89 yuan wool scarf",
    "1299 yuan air fryer",
    "259 yuan running shoes",
    "39 yuan snack gift box",
    "3999 yuan phone",
    "199 yuan serum set",
    "699 yuan office chair",
    "129 yuan cat litter bundle",
    "2599 yuan 14-inch laptop",
)


def tokens_of(text: str) -> int:
    """Tokens the emulator counts for `text`: one per started 4-byte piece."""
    return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN)


def _fit(paragraphs: list[str], tokens: int, header: str) -> str:
    """Join paragraphs up to `tokens` tokens and pad to exactly tokens*4 bytes (whole blocks)."""
    target = max(BLOCK_BYTES, (tokens * BYTES_PER_TOKEN) // BLOCK_BYTES * BLOCK_BYTES)
    text = header
    for paragraph in paragraphs:
        if len(text) + len(paragraph) > target:
            break
        text += paragraph
    return text + "." * (target - len(text))


def _written(header: str, tokens: int, paragraph: Callable[[int], str]) -> str:
    """Paragraphs 1, 2, ... from `paragraph(number)` until there is text enough for `tokens`
    (and some to spare), fitted after `header` by _fit."""
    paragraphs: list[str] = []
    while sum(map(len, paragraphs)) < tokens * BYTES_PER_TOKEN + 4096:
        paragraphs.append(paragraph(len(paragraphs) + 1))
    return _fit(paragraphs, tokens, header)


def rules_text(tokens: int = 60_000, seed: int = 0, edition: str = "Double 11") -> str:
    """The platform's marketing compliance rules: articles, commission table, banned words."""
    rng = random.Random(f"rules-{seed}-{edition}")

    def article_text(article: int) -> str:
        kind = article % 4
        category = rng.choice(CATEGORIES)
        if kind == 0:
            rate = rng.randint(2, 12) + rng.choice((0, 0.5))
            cap = rng.choice((50, 100, 200, 500))
            return (
                f"Article {article} (commission, {category}): the platform commission is "
                f"{rate}% of the paid price after all discounts, capped at {cap} yuan per "
                f"order; items under {rng.randint(5, 30)} yuan pay a flat "
                f"{rng.randint(1, 3)} yuan.\n"
            )
        if kind == 1:
            words = ", ".join(f'"{w}"' for w in rng.sample(BANNED, 4))
            return (
                f"Article {article} (advertising law, {category}): titles, images and live "
                f"speech must not contain {words}; a violation removes the listing for "
                f"{rng.randint(3, 30)} days and deducts {rng.randint(2, 12)} credit points.\n"
            )
        if kind == 2:
            first, second = rng.sample(MECHANICS, 2)
            return (
                f"Article {article} (discount priority, {category}): when {first} meets "
                f"{second}, apply the store discount first, then the platform coupon; the "
                f"final price must stay above {rng.randint(30, 70)}% of the lowest price of "
                f"the past {rng.choice((15, 30, 60))} days.\n"
            )
        return (
            f"Article {article} (price display, {category}): the crossed-out reference "
            f"price must be a real transaction price from the last "
            f"{rng.choice((7, 30))} days; 'from' prices need at least "
            f"{rng.randint(10, 40)}% of stock at that price; bundle prices list every "
            "item.\n"
        )

    header = (
        f"PLATFORM MARKETING COMPLIANCE RULES - {edition} mega-sale edition (seed {seed}).\n"
        "You are the promotion assistant. Check every merchant plan against the rules below, "
        "quote the article you apply, and never invent a rule.\n\n"
    )
    return _written(header, tokens, article_text)


def script_text(tokens: int = 12_000, seed: int = 0, topic: str = "live-stream") -> str:
    """A live-stream script template: beats, host lines and the rules a host must follow."""
    rng = random.Random(f"script-{seed}-{topic}")

    def beat_text(beat: int) -> str:
        product = rng.choice(PRODUCTS)
        mechanic = rng.choice(MECHANICS)
        return (
            f"Beat {beat} ({rng.randint(30, 180)} s): host greets the audience, shows the "
            f"{product}, explains the {mechanic}, reads the stock count every "
            f'{rng.randint(2, 5)} minutes and avoids "{rng.choice(BANNED)}"; '
            f"call to action at minute {rng.randint(1, 9)}.\n"
        )

    header = (
        f"LIVE-STREAM SCRIPT GUIDE - {topic} (seed {seed}).\n"
        "Draft a host script for the merchant's product, beat by beat, using only claims "
        "the compliance rules allow.\n\n"
    )
    return _written(header, tokens, beat_text)


def merchant_query(rng: random.Random, tokens: int = 200) -> str:
    """A merchant's thin query, padded with order context to about `tokens` tokens."""
    product = rng.choice(PRODUCTS)
    first, second = rng.sample(MECHANICS, 2)
    text = (
        f"\n\nMerchant {rng.randint(10_000, 99_999)} asks: set up a {first} plus {second} "
        f"script for this {product}; stock {rng.randint(50, 5000)} units, sale starts "
        f"{rng.choice(('20:00', '00:00', '10:00'))}. Is it compliant, and what is the final "
        "price?\nContext:"
    )
    while len(text) < tokens * BYTES_PER_TOKEN:
        text += f" order#{rng.randint(10**7, 10**8 - 1)} sku#{rng.randint(1000, 9999)}"
    return text[: tokens * BYTES_PER_TOKEN]
