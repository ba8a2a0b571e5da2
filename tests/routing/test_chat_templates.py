"""Where a raw prompt's assistant turns are, by its chat template (routing contract 9h): the
golden vectors, every template's next request naming its previous one's mark, and the
JSON-escaped body read in place."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from prefix_sidecar.routing.chat_templates import (
    NOT_FOLLOWED,
    TAIL,
    TEMPLATES,
    turn_marks,
    turn_marks_escaped,
)
from prefix_sidecar.routing.session_follow import NO_MARK
from prefix_sidecar_tools.emulator.protocol import render_chat

GOLDEN = Path(__file__).resolve().parents[1] / "core" / "golden.json"


def _golden() -> list[dict[str, object]]:
    cases = json.loads(GOLDEN.read_text(encoding="utf-8"))["organic"]["turn_marks"]
    assert isinstance(cases, list)
    return cases


@pytest.mark.parametrize("case", _golden(), ids=lambda case: repr(case["prompt"])[:40])
def test_the_contracts_vectors(case: dict[str, object]) -> None:
    prompt = case["prompt"]
    assert isinstance(prompt, str)
    assert list(turn_marks(prompt)) == case["marks"]
    if "\n" not in prompt:  # escaped offsets are the text's where nothing is escaped
        body = json.dumps({"prompt": prompt}, ensure_ascii=False).encode()
        start = body.index(b'"prompt": "') + len(b'"prompt": "')
        assert list(turn_marks_escaped(body, start, len(body) - 2)) == case["marks"]


def _conversation(opening: str, answer: str, turns: int, generation: bool) -> list[str]:
    """A conversation in one template, as its caller renders it at each turn."""
    prompts, text = [], opening + "system rules, long enough to matter.\n"
    for turn in range(turns):
        text += f"{opening}question {turn}\n"
        prompts.append(text + answer if generation else text)  # generation: the answer's header
        text += f"{answer}answer {turn}\n"
    return prompts


@pytest.mark.parametrize(("opening", "answer"), TEMPLATES)
@pytest.mark.parametrize("generation", [True, False])
def test_each_request_names_the_mark_its_previous_one_left(
    opening: str, answer: str, generation: bool
) -> None:
    prompts = _conversation(opening, answer, 5, generation)
    marks = [turn_marks(p) for p in prompts]
    for (mark, _), (_, after) in itertools.pairwise(marks):
        assert after == mark != NO_MARK  # the very next request
    # a request two turns later names a mark its predecessor's predecessor never left
    assert marks[3][1] != marks[1][0]
    assert marks[0][1] == (-1 if generation else NO_MARK)  # nothing came before the first


def test_the_emulators_chatml_rendering() -> None:
    first = [{"role": "system", "content": "rules"}, {"role": "user", "content": "q0"}]
    second = [*first, {"role": "assistant", "content": "a0"}, {"role": "user", "content": "q1"}]
    assert turn_marks(render_chat(second))[1] == turn_marks(render_chat(first))[0] >= 0


def test_not_a_rendered_conversation() -> None:
    # a template's header inside the text does not make it one: the start decides
    assert turn_marks("Rules. <|im_start|>assistant\n" * 3) == NOT_FOLLOWED
    assert turn_marks("x" * 100 + "<|im_start|>user\n") == NOT_FOLLOWED
    assert turn_marks("") == NOT_FOLLOWED
    # leading whitespace and a BOS are skipped; another template quoted inside is not read
    quoted = "\n <s> <|im_start|>user\nsay <|start_header_id|>assistant<|end_header_id|>"
    assert turn_marks(quoted) == (-1, NO_MARK)


def test_the_escaped_body_is_read_in_place() -> None:
    prompts = _conversation("<|im_start|>", "<|im_start|>assistant", 3, True)

    def marks_in_body(prompt: str, tail: bytes = b"") -> tuple[int, int]:
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode() + tail
        start = body.index(b'"prompt": "') + len(b'"prompt": "')
        return turn_marks_escaped(body, start, body.index(b'", "max_tokens"'))

    escaped = [marks_in_body(p + 'a "quoted" line\n') for p in prompts]
    assert escaped[2][1] == escaped[1][0] >= 0  # escaped offsets line up turn to turn
    # only body[start:end] is read: a header past `end` is not
    assert marks_in_body(prompts[2], b"<|im_start|>assistant") == marks_in_body(prompts[2])


def test_only_the_tail_is_read() -> None:
    """Headers are looked for in the last TAIL characters: an exchange longer than that is
    not followed (its request names nothing), and the next short one is again."""
    header = "<|im_start|>assistant\n"
    first = "<|im_start|>user\nq0<|im_end|>\n" + header
    long_answer = first + "x" * TAIL + "<|im_end|>\n<|im_start|>user\nq1<|im_end|>\n" + header
    short_answer = long_answer + "a1<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n" + header
    marks = [turn_marks(p) for p in (first, long_answer, short_answer)]
    assert marks[1] == (len(long_answer) - len(header), NO_MARK)  # the one before is too far
    assert marks[2][1] == marks[1][0]
    # a long prompt with no header in its tail: nothing known, nothing remembered
    assert turn_marks("<|im_start|>user\n" + "q" * TAIL) == NOT_FOLLOWED
