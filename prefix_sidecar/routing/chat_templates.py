"""Find a raw prompt's assistant turns from the chat template it was rendered with, so
session follow (routing contract 9h) can tell a raw conversation's very next request.

The template is the one whose first-turn header the prompt starts with (after whitespace
and an optional BOS), so a header quoted inside a message cannot change which is read. A
next request appends an answer and a question, so its second-to-last assistant header is
the previous request's last: each request leaves its last header's offset (MARK) and names
the one before (AFTER). Only the last TAIL characters are searched (two `rfind`s). A prompt
of no known template is NOT_FOLLOWED.
"""

from __future__ import annotations

import re
from typing import AnyStr

from prefix_sidecar.routing.session_follow import NO_MARK

# (the header a rendered prompt starts with, the header of an assistant turn), in the
# order they are tried. Every sidecar of a fleet must use the same table (contract 9h).
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("<|im_start|>", "<|im_start|>assistant"),  # ChatML: Qwen, Yi, Hermes, DeepSeek-V2 chat
    ("<|start_header_id|>", "<|start_header_id|>assistant<|end_header_id|>"),  # Llama 3
    ("<start_of_turn>", "<start_of_turn>model"),  # Gemma
    ("[INST]", "[/INST]"),  # Mistral, Llama 2: each [/INST] closes a user turn, an answer follows
    ("<|system|>", "<|assistant|>"),  # Phi-3, Zephyr
    ("<|user|>", "<|assistant|>"),
)
# Beginning-of-sequence texts a rendered template may start with (Llama 3, Gemma, Llama 2).
BOS = ("<|begin_of_text|>", "<bos>", "<s>")
_TEMPLATES_BYTES = tuple((s.encode(), a.encode()) for s, a in TEMPLATES)
_BOS_BYTES = tuple(b.encode() for b in BOS)
# Leading whitespace (ASCII: space, tab, CR, LF), and in a JSON body its escaped forms.
_SPACE = re.compile(r"[ \t\r\n]*")
_SPACE_ESCAPED = re.compile(rb"(?:[ \t\r\n]|\\[ntr])*")
NOT_FOLLOWED = (NO_MARK, NO_MARK)
# Headers are searched in the prompt's last 8,192 characters (escaped bytes in a JSON body):
# bounds the read per decision (~2 us); an exchange (answer and next question) longer than
# that is not followed, and goes to its session's pod.
TAIL = 8_192


def _marks(
    text: AnyStr,
    space: re.Pattern[AnyStr],
    templates: tuple[tuple[AnyStr, AnyStr], ...],
    boses: tuple[AnyStr, ...],
    start: int = 0,
    end: int | None = None,
) -> tuple[int, int]:
    """text[start:end]'s (mark, after), offsets from `start`, without copying it."""
    stop = len(text) if end is None else end
    at = space.match(text, start, stop).end()  # type: ignore[union-attr]  # always matches
    for bos in boses:
        if text.startswith(bos, at, stop):
            at = space.match(text, at + len(bos), stop).end()  # type: ignore[union-attr]
            break
    for opening, answer in templates:
        if text.startswith(opening, at, stop):
            low = max(start, stop - TAIL)  # headers farther from the end are not looked for
            whole = low == start
            last = text.rfind(answer, low, stop)
            if last < 0:  # no answer yet (its next request names -1), or none in the tail
                return (-1, NO_MARK) if whole else NOT_FOLLOWED
            before = text.rfind(answer, low, last)
            if before >= 0:
                return last - start, before - start
            return last - start, (-1 if whole else NO_MARK)
    return NOT_FOLLOWED


def turn_marks(prompt: str) -> tuple[int, int]:
    """(mark, after): the offset of the prompt's last assistant header by its chat template
    (-1: none), and of the one before it (-1: none; NO_MARK when the prompt has no
    assistant header at all, so no request came before it). NOT_FOLLOWED when the prompt
    does not start as a rendered conversation of a known template."""
    return _marks(prompt, _SPACE, TEMPLATES, BOS)


def turn_marks_escaped(body: bytes, start: int, end: int) -> tuple[int, int]:
    """`turn_marks` on a prompt as it lies JSON-escaped in body[start:end], in offsets of the
    escaped bytes from `start` (the headers hold no character canonical JSON escapes; a body
    escaping '<' or '/' anyway, \\u003c or \\/, reads as no template or no answers). Escaped
    offsets are not text offsets: a conversation alternating between the HTTP front and the
    Complete RPC is not followed across them."""
    return _marks(body, _SPACE_ESCAPED, _TEMPLATES_BYTES, _BOS_BYTES, start, end)
