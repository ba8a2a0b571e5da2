"""Where a raw prompt's assistant turns are, read from the chat template it was rendered
with (routing contract 9h): what lets session follow tell a raw conversation's very next
request, as a chat's assistant messages do.

Callers of /v1/completions (and of the Complete RPC) often render the model's chat
template themselves and send the conversation as one string. Such a prompt says where its
turns are: each assistant turn opens with the template's assistant header. The template is
recognised by how the prompt starts (after whitespace, an optional BOS, whitespace): a
rendered conversation starts with its template's first turn header, so a header of
another template quoted inside a message cannot change which one is read.

A conversation's next request is the previous one plus an answer and a new question: its
last assistant header is new, and the one before it is the previous request's last (a
trailing generation prompt - the header of the answer being asked for - is then the
header of the answer the next request carries; without one, the answers' own headers line
up the same way). So each request leaves the offset of its last assistant header (its
MARK) and names the offset of the one before (AFTER): a request whose AFTER is the mark
the same session's previous request left is its very next one. Only the end is read: two
`rfind`s over at most the prompt's last TAIL characters, not the whole prompt.

A prompt that starts with none of these is not a rendered conversation as far as routing
can tell: NO_MARK, never followed (routing as before).
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
# Headers are looked for in the prompt's last 8,192 characters (escaped bytes in a JSON
# body): what a decision reads is bounded (~2 us per look), and an exchange - an answer
# and the next question, ~2,000 tokens - longer than that is not followed (its request goes
# to its session's pod, as without follow).
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
    """The same, on a prompt as it lies in a JSON body, body[start:end] (its UTF-8,
    JSON-escaped), in offsets of the escaped bytes from `start`: the headers hold no
    character a canonical JSON escape changes. A body that escapes '<' or '/' anyway
    (\\u003c, \\/) reads as no template, or as no answers. The offsets are of the escaped
    body, not of the text: a conversation that goes back and forth between the HTTP front
    and the Complete RPC is not followed across them."""
    return _marks(body, _SPACE_ESCAPED, _TEMPLATES_BYTES, _BOS_BYTES, start, end)
