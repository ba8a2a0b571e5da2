"""From a checked request to a routing decision and, for Complete and Chat, the pod's body:
one `Planner` answers every RPC's "which prefix, which pod, what is sent".

A refusal raises RpcAbort with a status a client can branch on: unknown prefix NOT_FOUND, no
pod UNAVAILABLE, bad field INVALID_ARGUMENT (validation.py). The order is fixed: prefix and
input checked, call routed, then sampling fields and extra_json checked as the body is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from prefix_sidecar.abort import RpcAbort, invalid_argument
from prefix_sidecar.config import Config
from prefix_sidecar.prefixes import PrefixEntry, PrefixNotFound, PrefixStore
from prefix_sidecar.routing.cost import tokens_of
from prefix_sidecar.routing.decision import Decision, NoBackendError
from prefix_sidecar.routing.router import Router
from prefix_sidecar.routing.scope import NO_SCOPE, Scope, checked_salt
from prefix_sidecar.server.grpc.validation import (
    chat_messages,
    extra_members,
    sampling_params,
    text_field,
)
from prefix_sidecar.server.model_pool import ModelPool
from prefix_sidecar.upstream.body import SplicedBody, chat_body, completion_body, escape
from prefix_sidecar.upstream.relay import Relay
from prefix_sidecar.v1 import router_pb2

# What a pod's body is built from: sampling params, model, extra_json members.
BodyOf = Callable[[dict[str, object], str, bytes], SplicedBody]


@dataclass(frozen=True)
class UpstreamPlan:
    """A validated, routed streaming call: where it goes and what is sent."""

    decision: Decision
    entry: PrefixEntry | None
    path: str
    body: SplicedBody
    chat: bool
    named: str = ""  # the prefix_name the caller sent, if any
    raw_events: bool = False  # the caller wants each pod event's JSON in Chunk.events
    # Routed by the prompt: its text as /tokenize takes it (precise routing) and the model
    # the pod's body names ("": the pod's default), which tokenizes it.
    tokenize: dict[str, Any] | None = None
    model: str = ""
    scope: Scope = NO_SCOPE  # its adapter and cache salt, which key its blocks

    @property
    def prefix_label(self) -> str:
        """Usage is labelled with the name the caller used, else the entry's display name."""
        if self.named:
            return self.named
        return self.entry.name if self.entry is not None else "-"


@dataclass(frozen=True)
class StreamingRpc:
    """What differs between Complete and Chat once the request is checked."""

    name: str
    path: str
    chat: bool


COMPLETE = StreamingRpc("Complete", "/v1/completions", chat=False)
CHAT = StreamingRpc("Chat", "/v1/chat/completions", chat=True)


class Planner:
    """One pool's planning: its prefixes, its router and the relay to its pods."""

    def __init__(self, pool: ModelPool, several: bool = False) -> None:
        """`several`: the sidecar has other pools, so the model must be the typed field's."""
        self.pool = pool.name
        self._pod_model = pool.pod_model
        self._adapter_of = pool.adapter_of
        self._several = several
        self.config: Config = pool.config
        self.store: PrefixStore = pool.store
        self.router: Router = pool.router
        self.relay: Relay = pool.relay

    def decide(self, decide: Callable[[], Decision]) -> Decision:
        try:
            return decide()
        except NoBackendError as exc:
            raise RpcAbort(grpc.StatusCode.UNAVAILABLE, str(exc)) from None

    def entry(self, request: Any, which: str | None, scope: Scope = NO_SCOPE) -> PrefixEntry | None:
        """The prefix a request's prefix_id or prefix_name (`which`) names, NOT_FOUND when none
        is registered; None when `which` is another field."""
        try:
            if which == "prefix_id":
                return self.store.get(request.prefix_id)
            if which == "prefix_name":
                return self.store.by_name(request.prefix_name, scope)
        except PrefixNotFound as exc:
            raise RpcAbort(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        return None

    def scope(self, request: Any) -> Scope:
        """The request's adapter (its model, when the pool's pods hold one of that name) and
        cache salt (routing contract 10)."""
        try:
            salt = checked_salt(request.cache_salt)
        except ValueError as exc:
            raise invalid_argument(str(exc)) from None
        return Scope(self._adapter_of(request.model), salt)

    def route(self, request: router_pb2.RouteRequest) -> Decision:
        """The Route RPC's decision: by prefix id, by prefix name, or by a whole prompt."""
        which = request.WhichOneof("target")
        scope = self.scope(request)
        router = self.router
        entry = self.entry(request, which, scope)
        if entry is not None:
            return self.decide(lambda: router.for_prefix(entry, scope))
        if which == "prompt":
            prompt = text_field(
                request.prompt,
                "prompt",
                self.config.max_prefix_bytes + self.config.max_input_bytes,
                "config max_prefix_bytes + max_input_bytes",
            )
            return self.decide(lambda: router.for_prompt(prompt, scope=scope))
        raise invalid_argument("set one of prefix_id, prefix_name or prompt")

    def completion(self, request: router_pb2.CompleteRequest) -> UpstreamPlan:
        scope = self.scope(request)
        prefix, decision, entry = self._resolve_prefix(request, scope, len(request.input))
        user_input = text_field(request.input, "input", self.config.max_input_bytes)
        if decision is None and not user_input:
            raise invalid_argument(
                "no prefix and an empty input: set prefix_id, prefix_name or "
                "prefix_text, or send the whole prompt in input"
            )
        return self._plan(
            COMPLETE,
            request,
            (decision, entry),
            lambda: self.router.for_prompt(user_input, scope=scope),
            lambda params, model, extra: completion_body(prefix, user_input, params, model, extra),
            {"prompt": user_input},
            scope,
        )

    def chat(self, request: router_pb2.ChatRequest) -> UpstreamPlan:
        scope = self.scope(request)
        size = sum(len(message.content) for message in request.messages)
        prefix, decision, entry = self._resolve_prefix(request, scope, size)
        messages = chat_messages(request.messages, self.config.max_input_bytes)
        if not messages:
            raise invalid_argument(
                "messages is empty: send at least one message"
                + (" after the prefix" if decision is not None else "")
            )
        return self._plan(
            CHAT,
            request,
            (decision, entry),
            lambda: self.router.for_chat(
                [(m["role"], m["content"]) for m in messages], scope=scope
            ),
            lambda params, model, extra: chat_body(prefix, messages, params, model, extra),
            {"messages": messages},
            scope,
        )

    def _plan(
        self,
        rpc: StreamingRpc,
        request: Any,
        by_prefix: tuple[Decision | None, PrefixEntry | None],
        by_prompt: Callable[[], Decision],
        body_of: BodyOf,
        text: dict[str, Any],
        scope: Scope,
    ) -> UpstreamPlan:
        """Route by the prompt when no prefix routed the call, then build the pod's body."""
        decision, entry = by_prefix
        tokenize = None
        if decision is None:
            decision = self.decide(by_prompt)
            entry = decision.prefix
            tokenize = text if entry is None else None
        params, model, extra = self._body_fields(rpc.name, request)
        if scope.salt:
            params["cache_salt"] = scope.salt
        return UpstreamPlan(
            decision,
            entry,
            rpc.path,
            body_of(params, model, extra),
            chat=rpc.chat,
            named=request.prefix_name,
            raw_events=request.raw_events,
            tokenize=tokenize,
            model=model,
            scope=scope,
        )

    async def refined(self, plan: UpstreamPlan) -> UpstreamPlan:
        """With precise routing, an unregistered call moved to the pod holding the most of it."""
        precise = self.router.precise
        if precise is None or plan.tokenize is None:
            return plan
        decision = await precise.refine(plan.decision, plan.tokenize, plan.model, plan.scope)
        return dataclasses.replace(plan, decision=decision)

    def _resolve_prefix(
        self, request: Any, scope: Scope, query_chars: int
    ) -> tuple[bytes, Decision | None, PrefixEntry | None]:
        """(escaped prefix bytes, decision if routed by prefix, entry) for Complete/Chat;
        `query_chars`: the size of what follows the prefix (its weight in load, cost.py)."""
        tokens = tokens_of(query_chars)
        which = request.WhichOneof("prefix")
        entry = self.entry(request, which, scope)
        if entry is not None:
            decision = self.decide(lambda: self.router.for_prefix(entry, scope, tokens))
            return entry.json_bytes, decision, entry
        if which != "prefix_text":
            return b"", None, None
        text = text_field(request.prefix_text, "prefix_text", self.config.max_prefix_bytes)
        if not text:
            return b"", None, None
        decision = self.decide(lambda: self.router.for_prefix_text(text, scope, tokens))
        prefix = decision.prefix.json_bytes if decision.prefix is not None else escape(text)
        return prefix, decision, decision.prefix

    def _body_fields(self, rpc: str, request: Any) -> tuple[dict[str, object], str, bytes]:
        """(sampling params, model, extra_json members) for the pod's body. A model in
        extra_json replaces the configured default."""
        params = sampling_params(request)
        extra, keys = extra_members(request, rpc, params, self.config.max_input_bytes)
        if "model" in keys and self._several:
            raise invalid_argument(
                "extra_json sets model, but this sidecar has several pools and the model "
                "field picks one: set the model field instead"
            )
        model = request.model or ("" if "model" in keys else self.config.model)
        return params, self._pod_model(model), extra
