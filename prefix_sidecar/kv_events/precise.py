"""Precise organic routing's request step: an unregistered prompt's token ids, its longest
cached prefix per pod from the fleet's blocks (fleet_blocks.py, or the shared index:
kv_index/lookup.py), and the organic decision moved to the pod holding the most
(routing/precise.py).

Token ids come from the chosen pod's `POST /tokenize`, which renders a chat with its own
template: exact for any model, with no tokenizer file to keep in step. A pick that has not
answered within TOKENIZE_HEDGE_S is queueing, so the next pod of the preference is asked
beside it and the first answer wins; with none within TOKENIZE_TIMEOUT_S the organic
decision stands (docs/kv-events.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from prefix_sidecar.config import Config
from prefix_sidecar.kv_events.block_keys import PromptKeys
from prefix_sidecar.kv_events.expected import ContentInflow, ExpectedBlocks
from prefix_sidecar.metrics import Metrics
from prefix_sidecar.routing.decision import Decision
from prefix_sidecar.routing.pick import Branch
from prefix_sidecar.routing.precise import (
    BlockSource,
    DiscardBudget,
    Move,
    to_cached,
    to_emptiest,
    to_quickest,
)
from prefix_sidecar.routing.router import Router
from prefix_sidecar.routing.scope import NO_SCOPE, Scope
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.local_tokenizer import LocalTokenizer
from prefix_sidecar.upstream.tokenize import SPECIAL_TOKENS_SLACK, TokenizeError, tokens_of

logger = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 0.5
# Above a 19,371-token prompt's /tokenize on real vLLM (39 ms): a pick slower is queueing.
TOKENIZE_HEDGE_S = 0.05
# What a chat template adds around each message, in bytes at most.
TEMPLATE_BYTES_PER_MESSAGE = 64


@dataclasses.dataclass(eq=False)
class PreciseRouting:
    client: UpstreamClient
    blocks: BlockSource
    router: Router
    model: str = ""  # the pods' model, for /tokenize when the caller names none
    on_outcome: Callable[[str], None] = lambda outcome: None
    # what this sidecar has just sent where, before the pods' events say so
    expected: ExpectedBlocks = dataclasses.field(default_factory=ExpectedBlocks)
    inflow: ContentInflow = dataclasses.field(default_factory=ContentInflow)
    local: LocalTokenizer | None = None  # tokenizer_file: raw prompts' ids without a pod
    discards: DiscardBudget = dataclasses.field(default_factory=DiscardBudget)

    @classmethod
    def install(
        cls,
        client: UpstreamClient,
        blocks: BlockSource,
        router: Router,
        config: Config,
        metrics: Metrics,
    ) -> None:
        """Make this the router's precise step over `blocks`, counted in metrics; its
        credits end at the pods' first tokens (the relay tells the pool's queues)."""
        step = cls(
            client,
            blocks,
            router,
            model=config.model,
            local=LocalTokenizer.load(config.tokenizer_file) if config.tokenizer_file else None,
            on_outcome=lambda outcome: metrics.child(metrics.precise_decisions, outcome).inc(),
        )
        router.pool.queues.first_token_listeners.append(step.expected.prefilled)
        router.precise = step

    async def refine(
        self, decision: Decision, what: dict[str, Any], model: str = "", scope: Scope = NO_SCOPE
    ) -> Decision:
        """`decision` for an unregistered request whose text is `what` ({"prompt": ...} or
        {"messages": [...]}), moved to the pod holding the longest prefix of it, this step's time
        added to its decision_ns. Its blocks are keyed in `scope`, as the pods key them: by the
        LoRA adapter, and the first one by the cache salt too (block_keys.py)."""
        started = time.perf_counter_ns()
        moved = await self._moved(decision, what, model or self.model, scope)
        spent = decision.decision_ns + time.perf_counter_ns() - started
        return dataclasses.replace(moved, decision_ns=spent)

    async def _moved(
        self, decision: Decision, what: dict[str, Any], model: str, scope: Scope
    ) -> Decision:
        sizes = await self.blocks.block_sizes() if decision.prefix is None else None
        if not sizes:
            return decision
        try:
            tokens = await self.tokens(decision, what, model)
        except TokenizeError as exc:
            logger.debug("precise routing: /tokenize: %s", exc)
            self.on_outcome("tokenize_error")
            return decision
        size = min(sizes)
        prompt = PromptKeys(tokens, scope.adapter or None, scope.salt or None)
        held = self.expected.matches(prompt.at(size), size)  # what this sidecar just sent
        matches = await self.blocks.longest(prompt.at)
        if matches is None:
            self.on_outcome("no_answer")  # the index was slow or down: the hash decision
        else:
            for pod, cached in matches.items():
                held[pod] = max(held.get(pod, 0), cached)
            decision = self._place(decision, len(tokens), held)
        self.expected.expect(decision.backend, prompt.at(size))
        self.inflow.add(decision.backend, len(tokens) - held.get(decision.backend, 0))
        return decision

    def _place(self, decision: Decision, tokens: int, held: dict[str, int]) -> Decision:
        """`decision` moved to the pod that holds (or is about to hold) the most of the
        prompt's `tokens` if one fits; a prompt no pod holds, to the emptiest pod if it
        fits; then to the pod whose first token would come first by a margin, its prefill
        queue counted, if one fits."""
        router, table = self.router, self.router.pool.table
        move = Move(
            router.policy,
            table,
            decision.route_key,
            decision.backend,
            decision.preference,
            router.organic_floor,
            tokens,
        )
        if held:
            pod = to_cached(move, held)
            outcome, branch = ("moved", Branch.CACHED) if pod else ("kept", None)
        else:
            pod = to_emptiest(move, self.inflow.of(table.members))
            outcome, branch = ("placed", Branch.EMPTIEST) if pod else ("cold", None)
        backlog = router.pool.queues.backlog_tokens(table.members)
        current = pod or decision.backend
        quick = to_quickest(move, current, held, backlog, self.discards)
        if quick is not None:
            pod, outcome, branch = quick, "quickest", Branch.QUICKEST
        self.discards.settle(held.get(current, 0), held.get(quick or current, 0))
        self.on_outcome(outcome)
        if pod is None or branch is None:
            return decision
        rest = [p for p in decision.preference if p != pod]
        return dataclasses.replace(
            decision,
            backend=pod,
            preference=[pod, *rest][: router.max_attempts],
            branch=branch,
            forced=False,
            prefill=max(tokens - held.get(pod, 0), 0),
        )

    async def tokens(self, decision: Decision, what: dict[str, Any], model: str) -> list[int]:
        """The token ids: a raw prompt's from tokenizer_file once the pods have confirmed
        it (the pods' answer routes the prompts that check it), else the pods'."""
        local = self.local
        if local is None or "prompt" not in what or not local.usable:
            return await self.asked(decision, what, model)
        try:  # the pods' bound: a huge prompt's encode does not hold the request
            ids = await asyncio.wait_for(local.ids(str(what["prompt"])), TOKENIZE_TIMEOUT_S)
        except TimeoutError:
            raise TokenizeError(f"{local.name}: no ids within {TOKENIZE_TIMEOUT_S} s") from None
        if local.trusted:
            return ids
        answer = await self.asked(decision, what, model)
        local.compare(ids, answer)
        return answer

    async def asked(self, decision: Decision, what: dict[str, Any], model: str) -> list[int]:
        """The token ids from the organic pick, or from the next pod of the preference when
        the pick has not answered within TOKENIZE_HEDGE_S (or failed): whichever is first."""
        size = _text_bytes(what)
        pods = [decision.backend, *(p for p in decision.preference if p != decision.backend)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TOKENIZE_TIMEOUT_S
        asked: dict[asyncio.Task[list[int]], str] = {}

        def ask(pod: str) -> None:
            left = max(deadline - loop.time(), 0.001)
            call = tokens_of(self.client, pod, what, size, model=model, timeout_s=left)
            asked[loop.create_task(call)] = pod

        ask(pods[0])
        spare = pods[1:2]  # one more pod at most
        errors = []
        try:
            pending = set(asked)
            while pending:
                done, pending = await asyncio.wait(
                    pending,
                    timeout=TOKENIZE_HEDGE_S if spare else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for task in done:
                    if task.exception() is None:
                        return task.result()
                    errors.append(task)
                if spare:  # the pick failed, or is busy: no answer within the hedge
                    ask(spare.pop())
                    pending = {task for task in asked if not task.done()}
        finally:
            for task in asked:
                task.cancel()
        for task in errors:
            exc = task.exception()
            if exc is not None and not isinstance(exc, TokenizeError):
                raise exc  # a bug, not the pod's answer
        raise TokenizeError("; ".join(f"{asked[t]}: {t.exception()}" for t in errors))


def _text_bytes(what: dict[str, Any]) -> int:
    """The bytes the token ids may cover: the prompt, or the messages and their template."""
    if "prompt" in what:
        return len(str(what["prompt"]).encode("utf-8"))
    size = SPECIAL_TOKENS_SLACK
    for message in what.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        size += len(str(content or "").encode("utf-8")) + TEMPLATE_BYTES_PER_MESSAGE
    return size
