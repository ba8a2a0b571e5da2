"""Precise routing and cache_aware in the TTFT queue model
(prefix_sidecar_tools/bench/organic_ttft_precise.py)."""

from __future__ import annotations

from prefix_sidecar import _core
from prefix_sidecar.routing.cost import DECODE_TOKENS
from prefix_sidecar.routing.precise import DISCARD_BURST_TOKENS
from prefix_sidecar_tools.bench import organic_ttft_precise as precise_model
from prefix_sidecar_tools.bench.organic_trace import OrganicRequest
from prefix_sidecar_tools.bench.organic_ttft import PodModel
from prefix_sidecar_tools.emulator.config import BLOCK_SIZE
from prefix_sidecar_tools.emulator.tokenizer import block_hashes, count_tokens

PODS = PodModel()
RING = _core.Ring(["http://127.0.0.1:40001", "http://127.0.0.1:40002"])
PROMPT = "<|im_start|>system\n" + "rules of the shop. " * 120  # ~2,300 bytes


def _request(seq: int, prompt: str) -> OrganicRequest:
    return OrganicRequest(seq, "tenant", 0, seq, 0, (("system", prompt),), prompt, 0.0, 0.0)


def _chain(prompt: str) -> tuple[list[int], int]:
    data = prompt.encode()
    return block_hashes(data), count_tokens(data)


def test_pods_weigh_each_request_in_flight_in_tokens_until_its_answer_ends() -> None:
    pods = precise_model.TokenPods(1, PODS)
    chain, tokens = _chain(PROMPT)
    first = pods.serve(0, 0.0, chain, tokens)
    cached = pods.caches[0].hit_blocks(chain, tokens) * BLOCK_SIZE
    pods.serve(0, 0.0, chain, tokens)  # a repeat: only its tail past the whole blocks
    assert list(pods.token_loads(0.0)) == [tokens + (tokens - cached) + 2 * DECODE_TOKENS]
    assert list(pods.token_loads(first + PODS.answer_s + 1.0)) == [0]
    assert pods.hit_tokens == cached and pods.prompt_tokens == 2 * tokens


def test_the_pods_events_say_what_a_pod_holds_once_its_prefill_ended_until_it_evicts() -> None:
    pods = precise_model.TokenPods(2, PODS)
    view = pods.events
    chain, tokens = _chain(PROMPT)
    pods.serve(1, 0.0, chain, tokens)
    view.stored(1.0, 1, chain)
    view.advance(0.5)
    assert view.blocks(1, chain, tokens) == 0
    view.advance(1.0)
    whole = (tokens - 1) // BLOCK_SIZE
    assert view.blocks(1, chain, tokens) == whole
    assert view.blocks(0, chain, tokens) == 0
    # The pod fills with other prompts and evicts this one: its BlockRemoved goes out as it
    # evicts, so the view no longer credits the pod, though no new event was stored.
    for n in range(PODS.kv_tokens // 1000 + 2):
        other_chain, other_tokens = _chain(f"tenant {n}: " + "other rules. " * 400)
        pods.serve(1, 2.0 + n, other_chain, other_tokens)
    assert pods.caches[1].hit_blocks(chain, tokens) == 0
    assert view.blocks(1, chain, tokens) == 0


def test_a_precise_sidecar_follows_what_it_sent_then_sheds_cold_prompts_to_the_emptiest() -> None:
    """A repeat goes where this sidecar sent the prompt (credited before any event); with
    shed 0 a cold prompt goes to the pod sent the least new content, not to its hash pick."""
    choose = precise_model.precise(RING, chat=False, sidecars=1, shed=0.0)
    pods = precise_model.TokenPods(2, PODS)
    chain, tokens = _chain(PROMPT)
    first = choose(_request(0, PROMPT), chain, tokens, 0.0, pods)
    pods.serve(first, 0.0, chain, tokens)
    assert choose(_request(1, PROMPT), chain, tokens, 0.01, pods) == first
    other = "<|im_start|>system\n" + "another shop entirely. " * 100
    other_chain, other_tokens = _chain(other)
    assert choose(_request(2, other), other_chain, other_tokens, 0.02, pods) == 1 - first


def test_the_sweep_compares_each_router_with_radix_on_the_same_traces() -> None:
    outcomes = precise_model.sweep([0], 1, [1], [0.0], chat=False)
    assert list(outcomes) == ["radix", "precise_x1 shed 0"]
    lines = precise_model.describe(outcomes)
    assert "<= 1.05 x radix in  1/1" in lines[0]
    assert all(0.5 < o.fraction <= 1.0 + 1e-9 for runs in outcomes.values() for o in runs)


def test_a_precise_sidecar_leaves_a_holder_its_own_sends_have_queued() -> None:
    """The model runs the runtime's queue step (membership/prefill_queues.py on its clock): a
    repeat of a prompt leaves its holder while a long prompt this sidecar sent there just
    before is still in prefill, if its budget lets it discard what the holder has cached."""
    for saved, leaves in ((DISCARD_BURST_TOKENS, True), (0.0, False)):
        choose = precise_model.precise(RING, False, 1, 0.0, saved=saved)
        pods = precise_model.TokenPods(2, PODS)
        chain, tokens = _chain(PROMPT)
        holder = choose(_request(0, PROMPT), chain, tokens, 0.0, pods)
        done = pods.serve(holder, 0.0, chain, tokens)
        long = PROMPT + " and a long tail of rules." * 500  # ~3,100 tokens more, on the holder
        long_chain, long_tokens = _chain(long)
        at = done + 0.01
        assert choose(_request(1, long), long_chain, long_tokens, at, pods) == holder
        pods.serve(holder, at, long_chain, long_tokens)
        repeat = choose(_request(2, PROMPT), chain, tokens, at + 0.01, pods)
        assert repeat == (1 - holder if leaves else holder)
