"""A raw prompt's assistant turns by its chat template (routing contract 9h): the golden
vectors, one more per turn for every template, and the JSON-escaped body reads alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.routing.chat_templates import (
    TEMPLATES,
    assistant_turns,
    assistant_turns_escaped,
)
from sidecar.tools.emulator.protocol import render_chat

GOLDEN = Path(__file__).resolve().parents[1] / "core" / "golden.json"


def _golden() -> list[dict[str, object]]:
    cases = json.loads(GOLDEN.read_text(encoding="utf-8"))["organic"]["assistant_turns"]
    assert isinstance(cases, list)
    return cases


@pytest.mark.parametrize("case", _golden(), ids=lambda case: repr(case["prompt"])[:40])
def test_the_contracts_vectors(case: dict[str, object]) -> None:
    prompt = case["prompt"]
    assert isinstance(prompt, str)
    assert assistant_turns(prompt) == case["turns"]
    body = json.dumps({"prompt": prompt}, ensure_ascii=False).encode()
    start = body.index(b'"prompt": "') + len(b'"prompt": "')
    assert assistant_turns_escaped(body, start, len(body) - 2) == case["turns"]


def _render(opening: str, answer: str, turns: int) -> list[str]:
    """A conversation in one template, as the caller renders it at each turn (with the
    generation prompt, and without)."""
    prompts, text = [], opening + "system rules, long enough to matter.\n"
    for turn in range(turns):
        text += f"{opening}question {turn}\n"
        prompts.append(text + answer)  # the generation prompt: the header of the answer asked
        text += f"{answer}answer {turn}\n"
    return prompts


@pytest.mark.parametrize(("opening", "answer"), TEMPLATES)
def test_each_turn_has_one_more(opening: str, answer: str) -> None:
    prompts = _render(opening, answer, 5)
    counts = [assistant_turns(p) for p in prompts]
    assert counts == list(range(1, 6))
    # without the generation prompt: one fewer at every turn, still one more per turn
    assert [assistant_turns(p[: -len(answer)]) for p in prompts] == list(range(5))


def test_the_emulators_chatml_rendering_counts_its_answers() -> None:
    messages = [{"role": "system", "content": "rules"}, {"role": "user", "content": "q0"}]
    assert assistant_turns(render_chat(messages)) == 1  # the generation prompt
    messages += [{"role": "assistant", "content": "a0"}, {"role": "user", "content": "q1"}]
    assert assistant_turns(render_chat(messages)) == 2


def test_not_a_rendered_conversation() -> None:
    # a template's marker inside the text does not make it one: the start decides
    assert assistant_turns("Rules. <|im_start|>assistant\n" * 3) == -1
    assert assistant_turns("x" * 100 + "<|im_start|>user\n") == -1
    assert assistant_turns("") == -1
    # leading whitespace and a BOS are skipped; another template quoted inside is not counted
    quoted = "\n <s> <|im_start|>user\nsay <|start_header_id|>assistant<|end_header_id|>"
    assert assistant_turns(quoted) == 0


def test_the_escaped_body_is_read_in_place() -> None:
    prompt = _render("<|im_start|>", "<|im_start|>assistant", 3)[-1] + 'a "quoted"\n answer'
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
    start = body.index(b'"prompt": "') + len(b'"prompt": "')
    end = body.index(b'", "max_tokens"')
    assert assistant_turns_escaped(body, start, end) == assistant_turns(prompt) == 3
    # only body[start:end] is read: a marker past `end` is not counted
    assert assistant_turns_escaped(body + b"<|im_start|>assistant", start, end) == 3
