"""A raw prompt's assistant turns, read from the chat template it was rendered with
(routing contract 9h): what lets session follow tell a raw conversation's very next
request, as a chat's assistant messages do.

Callers of /v1/completions (and of the Complete RPC) often render the model's chat
template themselves and send the conversation as one string. Such a prompt says where its
turns are: each assistant turn opens with the template's assistant header. The template is
recognised by how the prompt starts (after whitespace, an optional BOS, whitespace): a rendered
conversation starts with its template's first turn header, so a marker of another template
quoted inside a message cannot change which one is counted. Its assistant headers are then
counted over the whole prompt. Each turn adds exactly one, so a conversation's very next
request has one more than the one before it (a trailing generation prompt, the header of
the turn being asked for, adds one to every request alike).

A prompt that starts with none of these is not a rendered conversation as far as routing
can tell: -1, never followed (routing as before). Linear and bounded: one startswith per
template where the prompt starts, one `count` (C speed) over the prompt: 6 us for 32 KB.
"""

from __future__ import annotations

import re
from typing import AnyStr

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


def _turns(
    text: AnyStr,
    space: re.Pattern[AnyStr],
    templates: tuple[tuple[AnyStr, AnyStr], ...],
    boses: tuple[AnyStr, ...],
    start: int = 0,
    end: int | None = None,
) -> int:
    """text[start:end]'s turns, without copying it."""
    stop = len(text) if end is None else end
    at = space.match(text, start, stop).end()  # type: ignore[union-attr]  # always matches
    for bos in boses:
        if text.startswith(bos, at, stop):
            at = space.match(text, at + len(bos), stop).end()  # type: ignore[union-attr]
            break
    for opening, answer in templates:
        if text.startswith(opening, at, stop):
            return text.count(answer, start, stop)
    return -1


def assistant_turns(prompt: str) -> int:
    """The assistant headers of the prompt's chat template, counted over the whole prompt;
    -1 when it does not start as a rendered conversation of a known template."""
    return _turns(prompt, _SPACE, TEMPLATES, BOS)


def assistant_turns_escaped(body: bytes, start: int, end: int) -> int:
    """The same, on a prompt as it lies in a JSON body, body[start:end] (its UTF-8,
    JSON-escaped): the markers hold no character a canonical JSON escape changes. A body
    that escapes '<' or '/' anyway (\\u003c, \\/) reads as no template, or as no answers:
    not followed."""
    return _turns(body, _SPACE_ESCAPED, _TEMPLATES_BYTES, _BOS_BYTES, start, end)
