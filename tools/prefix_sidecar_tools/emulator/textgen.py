"""Deterministic output text: one word per token, drawn from a seeded RNG, with stop strings.

The seed key is (request seed, prompt digest); with temperature 0 and no seed the text
depends on the prompt only (greedy decoding is deterministic in vLLM too); with neither
it is random. Stop strings are handled like vLLM: the text up to (excluding) the first
stop string is returned, and while streaming the last len(longest stop)-1 characters are
held back so that no part of a stop string is ever emitted.
"""

from __future__ import annotations

import hashlib
import os
import random

_WORDS_TEXT = (
    "promotion merchant coupon discount cross-store stacked rule compliance banned word "
    "advertising law commission category price jacket down live-stream script offer limited "
    "flash sale bundle second item half off threshold reach minus platform subsidy gift card "
    "member points shipping free return seven days guarantee authentic brand official store "
    "audience host recommend quality warm winter new arrival best seller stock inventory "
    "deadline midnight peak traffic order checkout payment refund"
)
WORDS = tuple(_WORDS_TEXT.split())


def make_rng(seed: int | None, temperature: float, prompt: bytes) -> random.Random:
    """The RNG for one request (see module docstring for when it is deterministic)."""
    if seed is None and temperature > 0:
        return random.Random(os.urandom(16))
    digest = hashlib.blake2b(prompt, digest_size=16).digest()
    key = b"greedy" if seed is None else seed.to_bytes(16, "little", signed=True)
    return random.Random(hashlib.blake2b(key + digest, digest_size=16).digest())


class TextStream:
    """Accumulates generated tokens and says what may be shown, honouring stop strings."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self._shown = 0
        self.stop_reason: str | None = None

    def push(self, token_text: str) -> str:
        """Add a token; return newly visible text. Sets stop_reason if a stop string ends it."""
        search_from = max(0, len(self.text) - self._hold)
        self.text += token_text
        first: tuple[int, str] | None = None
        for stop in self.stops:
            index = self.text.find(stop, search_from)
            if index >= 0 and (first is None or index < first[0]):
                first = (index, stop)
        if first is not None:
            self.text = self.text[: first[0]]
            self.stop_reason = first[1]
            return self.flush()
        visible_end = len(self.text) - self._hold
        if visible_end <= self._shown:
            return ""
        delta = self.text[self._shown : visible_end]
        self._shown = visible_end
        return delta

    def flush(self) -> str:
        """Everything not shown yet (at the end of generation)."""
        delta = self.text[self._shown :]
        self._shown = len(self.text)
        return delta


def next_token(rng: random.Random) -> str:
    return " " + rng.choice(WORDS)
