"""Precise organic routing's request step: an unregistered prompt's token ids from a pod's
`POST /tokenize`, its longest cached prefix per pod from the fleet's blocks (this sidecar's
own, fleet_blocks.py, or the shared index's, kv_index/source.py), and the organic decision
moved to the pod that holds more of it (routing/precise.py).

Token ids come from the pod the organic decision chose, which renders a chat with its own
template, as it will for the request: exact for prompts and chats of any model, with no
tokenizer file to keep in step with the pods. Its cost, measured on real vLLM (tiny model,
this 2-core box): 1.7 ms at 255 tokens, 5.4 ms at 2,454, 39 ms at 19,371, one at a time;
a local `tokenizers` encode of the same took 0.3, 2.8 and 27 ms, but renders no chat. The
call is bounded by TOKENIZE_TIMEOUT_S; any failure keeps the organic decision.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from prefix_sidecar.config import Config
from prefix_sidecar.metrics import Metrics
from prefix_sidecar.routing.decision import Decision
from prefix_sidecar.routing.pick import Branch
from prefix_sidecar.routing.precise import BlockSource, to_cached
from prefix_sidecar.routing.router import Router
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.tokenize import SPECIAL_TOKENS_SLACK, TokenizeError, tokens_of

logger = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 0.5
# What a chat template adds around each message, in bytes at most.
TEMPLATE_BYTES_PER_MESSAGE = 64
OUTCOMES = ("moved", "kept", "cold", "tokenize_error", "no_answer")


@dataclasses.dataclass(eq=False)
class PreciseRouting:
    client: UpstreamClient
    blocks: BlockSource
    router: Router
    model: str = ""  # the pods' model, for /tokenize when the caller names none
    on_outcome: Callable[[str], None] = lambda outcome: None

    @classmethod
    def install(
        cls,
        client: UpstreamClient,
        blocks: BlockSource,
        router: Router,
        config: Config,
        metrics: Metrics,
    ) -> None:
        """Make this the router's precise step over `blocks`, counted in metrics."""
        router.precise = cls(
            client,
            blocks,
            router,
            model=config.model,
            on_outcome=lambda outcome: metrics.child(metrics.precise_decisions, outcome).inc(),
        )

    async def refine(self, decision: Decision, what: dict[str, Any], model: str = "") -> Decision:
        """`decision` for an unregistered request whose text is `what` ({"prompt": ...} or
        {"messages": [...]}), moved to the pod holding the longest prefix of it."""
        if decision.prefix is not None or not await self.blocks.ready():
            return decision
        try:
            tokens = await tokens_of(
                self.client,
                decision.backend,
                what,
                _text_bytes(what),
                model=model or self.model,
                timeout_s=TOKENIZE_TIMEOUT_S,
            )
        except TokenizeError as exc:
            logger.debug("precise routing: %s/tokenize: %s", decision.backend, exc)
            self.on_outcome("tokenize_error")
            return decision
        matches = await self.blocks.longest(tokens)
        if matches is None:
            self.on_outcome("no_answer")  # the index was slow or down: the hash decision
            return decision
        if not matches:
            self.on_outcome("cold")
            return decision
        router = self.router
        table = router.pool.table
        pod = to_cached(
            router.policy,
            table,
            decision.route_key,
            decision.backend,
            decision.preference,
            matches,
            router.organic_floor,
            len(tokens),
        )
        if pod is None:
            self.on_outcome("kept")
            return decision
        self.on_outcome("moved")
        rest = [p for p in decision.preference if p != pod]
        return dataclasses.replace(
            decision,
            backend=pod,
            preference=[pod, *rest][: router.max_attempts],
            branch=Branch.CACHED,
            forced=False,
            prefill=max(len(tokens) - matches[pod], 0),
        )


def _text_bytes(what: dict[str, Any]) -> int:
    """The bytes the token ids may cover: the prompt, or the messages and their template."""
    if "prompt" in what:
        return len(str(what["prompt"]).encode("utf-8"))
    size = SPECIAL_TOKENS_SLACK
    for message in what.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        size += len(str(content or "").encode("utf-8")) + TEMPLATE_BYTES_PER_MESSAGE
    return size
