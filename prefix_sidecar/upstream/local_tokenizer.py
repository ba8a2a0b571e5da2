"""A raw prompt's token ids from the pods' own tokenizer file (`tokenizer_file`, a
tokenizer.json read with `tokenizers`, the `tokenizer` extra), so precise routing need not ask
a pod's `POST /tokenize`: a CPU pod answers it behind its prefills, serialised by its API
server (docs/kv-events.md). A chat still goes to a pod, which alone renders its template.

Trust is earned: the first CHECKS prompts are tokenized by a pod too, whose ids route them.
One disagreement (another model's file, other special tokens) and the file is dropped with a
warning: every prompt then goes to the pods as without it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prefix_sidecar.config.checks import ConfigError

logger = logging.getLogger(__name__)

CHECKS = 3
# Prompts up to this many UTF-8 bytes are encoded on the event loop (3.2 KB took 1.0 ms, 25 KB
# 7.9); bigger ones in a thread via encode_batch, which releases the GIL (encode would not).
INLINE_BYTES = 16 * 1024


class LocalTokenizer:
    """Token ids of prompts, with add_special_tokens as vLLM tokenizes a completion's."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self._tokenizer = tokenizer
        self.name = name
        self.agreed = 0  # prompts whose ids a pod confirmed
        self.disagreed = False

    @classmethod
    def load(cls, path: str) -> LocalTokenizer:
        """The tokenizer at `path`; ConfigError naming the field when it cannot be read.
        (config/table.py has checked that `tokenizers` is installed.)"""
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(path), path)
        except Exception as exc:  # the library raises its own Exception for a bad file
            raise ConfigError(
                f"config field 'tokenizer_file': {path} is not a tokenizer.json ({exc})"
            ) from None

    @property
    def trusted(self) -> bool:
        return self.agreed >= CHECKS and not self.disagreed

    @property
    def usable(self) -> bool:
        return not self.disagreed

    async def ids(self, prompt: str) -> list[int]:
        size = len(prompt) if prompt.isascii() else len(prompt.encode("utf-8"))
        if size <= INLINE_BYTES:
            return list(self._tokenizer.encode(prompt).ids)
        batch = await asyncio.to_thread(self._tokenizer.encode_batch, [prompt])
        return list(batch[0].ids)

    def compare(self, local: list[int], pod: list[int]) -> None:
        """Count one agreement with a pod's ids, or stop using the file on a difference."""
        if local == pod:
            self.agreed += 1
            if self.trusted:
                logger.info("precise routing: %s agrees with the pods: used for prompts", self.name)
            return
        self.disagreed = True
        pairs = zip(local, pod, strict=False)
        at = next((n for n, (a, b) in enumerate(pairs) if a != b), min(len(local), len(pod)))
        logger.warning(
            "precise routing: tokenizer_file %s does not give the pods' token ids "
            "(%d ids against the pod's %d, first difference at id %d); every prompt is "
            "tokenized by a pod's /tokenize instead",
            self.name,
            len(local),
            len(pod),
            at,
        )
