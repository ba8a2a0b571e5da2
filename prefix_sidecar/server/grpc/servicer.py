"""The sidecar.v1.Router servicer: the RPCs. Each checks its request (validation.py), routes
it, and for Complete and Chat relays the pod's answer (relay.py) and records the outcome
(request_log.py).

Every refusal carries a gRPC status a client can branch on and a message that says what
to fix (docs/api.md lists them): code below raises RpcAbort, the RPC turns it into its
status. Handlers never let an exception escape as UNKNOWN: an unexpected bug is logged and
reported as INTERNAL, and the sidecar keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from prefix_sidecar.abort import RpcAbort, invalid_argument
from prefix_sidecar.config import Config
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.metrics import FRONT_GRPC, Metrics
from prefix_sidecar.prefixes import PrefixEntry, PrefixError, PrefixNotFound, PrefixStore
from prefix_sidecar.prewarm import FAILED, WARMED, Prewarmer, WarmEvent
from prefix_sidecar.routing.router import Decision, NoBackendError, Router
from prefix_sidecar.server.common.request_log import record_outcome
from prefix_sidecar.server.common.trace_context import TraceContext
from prefix_sidecar.server.grpc.early_headers import EarlyHeaders
from prefix_sidecar.server.grpc.validation import (
    chat_messages,
    extra_members,
    registration_text,
    sampling_params,
    text_field,
)
from prefix_sidecar.upstream import caller
from prefix_sidecar.upstream.body import SplicedBody, chat_body, completion_body, escape
from prefix_sidecar.upstream.relay import Relay, RelayOutcome
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger("sidecar.requests")

T = TypeVar("T")


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

    @property
    def prefix_label(self) -> str:
        """Usage is labelled with the name the caller used, else the entry's display name."""
        if self.named:
            return self.named
        return self.entry.name if self.entry is not None else "-"


def _status_on_error(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """End a unary RPC with RpcAbort's status, or INTERNAL for an unexpected bug."""

    @functools.wraps(method)
    async def wrapper(self: RouterServicer, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await method(self, request, context)
        except RpcAbort as exc:
            await context.abort(exc.code, exc.message)
        except Exception:
            logger.exception("%s failed unexpectedly", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__}: internal error")
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    return wrapper


async def _abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, outcome: RelayOutcome
) -> None:
    """End a stream with a status; a caller already gone cannot get one (see _stream)."""
    try:
        await context.abort(code, message)
    except grpc.aio.InternalError:
        outcome.status = caller.ended_status(context)
        raise asyncio.CancelledError from None


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        config: Config,
        store: PrefixStore,
        pool: BackendPool,
        router: Router,
        relay: Relay,
        prewarmer: Prewarmer,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.store = store
        self.pool = pool
        self.router = router
        self.relay = relay
        self.prewarmer = prewarmer
        self.metrics = metrics

    # --- prefixes -----------------------------------------------------------------------

    @_status_on_error
    async def RegisterPrefix(
        self, request: router_pb2.RegisterPrefixRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.Prefix:
        text = registration_text(request, self.config.max_prefix_bytes)
        try:
            entry, created = self.store.register(request.name, text, request.replicas)
        except PrefixError as exc:
            raise invalid_argument(str(exc)) from None
        logger.info(
            "prefix %s registered as %s (%d bytes, %s)",
            request.name,
            entry.id[:12],
            entry.size,
            "new" if created else "already known",
        )
        reply = self._prefix_message(request.name, entry)
        if request.prewarm:
            targets = self.router.home_set(entry)
            if not targets:
                raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "no pod to prewarm on: none is up")
            for event in await self.prewarmer.warm_all([(entry, url) for url in targets]):
                self._note_warm(entry, event)
                reply.prewarm.append(_event_message(event))
        return reply

    @_status_on_error
    async def UnregisterPrefix(
        self, request: router_pb2.UnregisterPrefixRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.UnregisterPrefixReply:
        which = request.WhichOneof("prefix")
        try:
            if which == "prefix_id":
                names = self.store.names_of(request.prefix_id)
                removed = self.store.unregister_id(request.prefix_id)
            elif which == "prefix_name":
                names = (request.prefix_name,)
                removed = self.store.unregister_name(request.prefix_name)
            else:
                raise invalid_argument("set prefix_id or prefix_name to unregister")
        except PrefixNotFound as exc:
            raise RpcAbort(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        for prefix_id in removed:
            self.pool.forget_prefix(prefix_id)
        # The token series of every name that no longer points at a text.
        for name in names:
            if not self.store.has_name(name):
                self.metrics.forget_prefix(name)
        return router_pb2.UnregisterPrefixReply(removed_ids=removed)

    @_status_on_error
    async def ListPrefixes(
        self, request: router_pb2.ListPrefixesRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListPrefixesReply:
        # One item per (name, version): a text registered under two names is listed twice.
        return router_pb2.ListPrefixesReply(
            prefixes=[self._prefix_message(name, entry) for name, entry in self.store.named()]
        )

    def _prefix_message(self, name: str, entry: PrefixEntry) -> router_pb2.Prefix:
        return router_pb2.Prefix(
            id=entry.id,
            name=name,
            bytes=entry.size,
            route_key=entry.route_key,
            replicas=self.router.replicas_of(entry),
            backends=self.router.home_set(entry),
            versions=self.store.versions(name),
        )

    # --- routing ------------------------------------------------------------------------

    @_status_on_error
    async def Route(
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteReply:
        which = request.WhichOneof("target")
        if which == "prefix_id":
            decision = self._decide(lambda: self.router.for_prefix(self._by_id(request.prefix_id)))
        elif which == "prefix_name":
            decision = self._decide(
                lambda: self.router.for_prefix(self._by_name(request.prefix_name))
            )
        elif which == "prompt":
            prompt = text_field(
                request.prompt,
                "prompt",
                self.config.max_prefix_bytes + self.config.max_input_bytes,
                "config max_prefix_bytes + max_input_bytes",
            )
            decision = self._decide(lambda: self.router.for_prompt(prompt))
        else:
            raise invalid_argument("set one of prefix_id, prefix_name or prompt")
        self.metrics.child(self.metrics.decision, FRONT_GRPC, "Route").observe(
            decision.decision_ns / 1e9
        )
        return router_pb2.RouteReply(
            backend=decision.backend,
            preference=decision.preference,
            prefix_id=decision.prefix.id if decision.prefix else "",
            route_key=decision.route_key,
            branch=decision.branch,
            decision_ns=decision.decision_ns,
        )

    def _decide(self, decide: Callable[[], Decision]) -> Decision:
        try:
            return decide()
        except NoBackendError as exc:
            raise RpcAbort(grpc.StatusCode.UNAVAILABLE, str(exc)) from None

    def _by_id(self, prefix_id: str) -> PrefixEntry:
        try:
            return self.store.get(prefix_id)
        except PrefixNotFound as exc:
            raise RpcAbort(grpc.StatusCode.NOT_FOUND, str(exc)) from None

    def _by_name(self, name: str) -> PrefixEntry:
        try:
            return self.store.by_name(name)
        except PrefixNotFound as exc:
            raise RpcAbort(grpc.StatusCode.NOT_FOUND, str(exc)) from None

    def _resolve_prefix(self, request: Any) -> tuple[bytes, Decision | None, PrefixEntry | None]:
        """(escaped prefix bytes, decision if routed by prefix, entry) for Complete/Chat."""
        which = request.WhichOneof("prefix")
        if which == "prefix_id":
            entry = self._by_id(request.prefix_id)
        elif which == "prefix_name":
            entry = self._by_name(request.prefix_name)
        elif which == "prefix_text":
            text = text_field(request.prefix_text, "prefix_text", self.config.max_prefix_bytes)
            if not text:
                return b"", None, None
            decision = self._decide(lambda: self.router.for_prefix_text(text))
            prefix = decision.prefix.json_bytes if decision.prefix is not None else escape(text)
            return prefix, decision, decision.prefix
        else:
            return b"", None, None
        return entry.json_bytes, self._decide(lambda: self.router.for_prefix(entry)), entry

    # --- streaming ----------------------------------------------------------------------

    # Complete and Chat are coroutines that send with context.write, not async generators:
    # every generator layer between grpc and the relay is resumed for each chunk, the first
    # token's included.

    async def Complete(
        self, request: router_pb2.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self._stream("Complete", self._plan_completion, request, context)

    async def Chat(
        self, request: router_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self._stream("Chat", self._plan_chat, request, context)

    def _plan_completion(self, request: router_pb2.CompleteRequest) -> UpstreamPlan:
        prefix, decision, entry = self._resolve_prefix(request)
        user_input = text_field(request.input, "input", self.config.max_input_bytes)
        if decision is None:
            if not user_input:
                raise invalid_argument(
                    "no prefix and an empty input: set prefix_id, prefix_name or "
                    "prefix_text, or send the whole prompt in input"
                )
            decision = self._decide(lambda: self.router.for_prompt(user_input))
            entry = decision.prefix
        params, model, extra = self._body_fields("Complete", request)
        body = completion_body(prefix, user_input, params, model, extra)
        return UpstreamPlan(
            decision,
            entry,
            "/v1/completions",
            body,
            chat=False,
            named=request.prefix_name,
            raw_events=request.raw_events,
        )

    def _plan_chat(self, request: router_pb2.ChatRequest) -> UpstreamPlan:
        prefix, decision, entry = self._resolve_prefix(request)
        messages = chat_messages(request.messages, self.config.max_input_bytes)
        if not messages:
            raise invalid_argument(
                "messages is empty: send at least one message"
                + (" after the prefix" if decision is not None else "")
            )
        if decision is None:
            turns = [(m["role"], m["content"]) for m in messages]
            decision = self._decide(lambda: self.router.for_chat(turns))
            entry = decision.prefix
        params, model, extra = self._body_fields("Chat", request)
        body = chat_body(prefix, messages, params, model, extra)
        return UpstreamPlan(
            decision,
            entry,
            "/v1/chat/completions",
            body,
            chat=True,
            named=request.prefix_name,
            raw_events=request.raw_events,
        )

    def _body_fields(self, rpc: str, request: Any) -> tuple[dict[str, object], str, bytes]:
        """(sampling params, model, extra_json members) for the pod's body. A model in
        extra_json replaces the configured default."""
        params = sampling_params(request)
        extra, keys = extra_members(request, rpc, params, self.config.max_input_bytes)
        model = request.model or ("" if "model" in keys else self.config.model)
        return params, model, extra

    async def _stream(
        self,
        rpc: str,
        plan: Callable[[Any], UpstreamPlan],
        request: Any,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Validate and route (plan), relay the pod's stream with the caller's trace
        headers, and log/measure the outcome."""
        started = time.perf_counter()
        outcome = RelayOutcome()
        branch = prefix_label = ""
        writing = False
        headers: EarlyHeaders | None = None
        trace = TraceContext.from_metadata(context.invocation_metadata())
        caller.watch(context)
        try:
            upstream = plan(request)
            branch = upstream.decision.branch
            prefix_label = upstream.prefix_label
            decision_ns = upstream.decision.decision_ns
            self.metrics.child(self.metrics.decision, FRONT_GRPC, rpc).observe(decision_ns / 1e9)
            headers = EarlyHeaders(context)
            chunks = self.relay.stream(
                upstream.decision.preference,
                upstream.path,
                upstream.body,
                chat=upstream.chat,
                raw_events=upstream.raw_events,
                time_remaining=context.time_remaining,
                outcome=outcome,
                on_accepted=headers.send,
                headers=trace.http_headers(),
                forced_first=upstream.decision.forced,
            )
            # aclosing: however the call ends, the relay's cleanup (pod connection, in-flight
            # count) runs now, not when the abandoned generator is collected.
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if headers.pending:
                        await headers.settle()
                    writing = True
                    await context.write(chunk)
                    writing = False
        except RpcAbort as exc:
            outcome.status = exc.code.name
            if headers is not None:
                await headers.settle()
            await _abort(context, exc.code, exc.message, outcome)
        except asyncio.CancelledError:
            # grpc cancels the task when the caller cancels or its deadline ends.
            outcome.status = caller.ended_status(context)
            raise
        except Exception as exc:
            if writing:
                # The call ended under us: the caller went away, or the server is stopping.
                outcome.status = caller.ended_status(context)
                if isinstance(exc, grpc.aio.InternalError):
                    # Core failed the write: a cancelled call, not an error of ours. grpc
                    # logs a cancel at DEBUG, a failed batch as ERROR with a traceback.
                    raise asyncio.CancelledError from None
                raise
            outcome.status = "INTERNAL"
            logger.exception("%s failed unexpectedly", rpc)
            if headers is not None:
                await headers.settle()
            await _abort(context, grpc.StatusCode.INTERNAL, f"{rpc}: internal error", outcome)
        finally:
            record_outcome(
                self.metrics, rpc, prefix_label, branch, outcome, started, trace, front=FRONT_GRPC
            )

    async def Prewarm(
        self, request: router_pb2.PrewarmRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.PrewarmEvent]:
        try:
            which = request.WhichOneof("prefix")
            if which == "prefix_id":
                entry = self._by_id(request.prefix_id)
            elif which == "prefix_name":
                entry = self._by_name(request.prefix_name)
            else:
                raise invalid_argument("set prefix_id or prefix_name")
            if request.all_backends:
                targets = [b.url for b in self.pool.backends.values() if b.healthy is not False]
            else:
                targets = self.router.home_set(entry)
            if not targets:
                raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "no pod to prewarm on: none is up")
        except RpcAbort as exc:
            await context.abort(exc.code, exc.message)
            return
        async for event in self.prewarmer.run([(entry, url) for url in targets]):
            self._note_warm(entry, event)
            yield _event_message(event)

    def _note_warm(self, entry: PrefixEntry, event: WarmEvent) -> None:
        # A prewarm that ends after its prefix was unregistered must not list it as warm.
        if event.state == WARMED and self.store.has_id(entry.id):
            self.pool.note_warm_prefix(event.backend, entry.id)
        if event.state in (WARMED, FAILED):
            self.metrics.child(self.metrics.prewarm, event.backend, event.state.lower()).inc()

    @_status_on_error
    async def ListBackends(
        self, request: router_pb2.ListBackendsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListBackendsReply:
        backends = [
            router_pb2.Backend(
                url=b.url,
                healthy=bool(b.healthy),
                state=b.state,
                weight=b.weight,
                in_flight=b.in_flight,
                warm_prefixes=sorted(b.warm_prefixes),
                last_error=b.last_error,
            )
            for b in sorted(self.pool.backends.values(), key=lambda b: b.url)
        ]
        return router_pb2.ListBackendsReply(backends=backends, generation=self.pool.generation)


def _event_message(event: WarmEvent) -> router_pb2.PrewarmEvent:
    return router_pb2.PrewarmEvent(
        backend=event.backend,
        state=router_pb2.PrewarmEvent.State.Value(event.state),  # type: ignore[arg-type]
        prompt_tokens=event.prompt_tokens,
        cached_tokens=event.cached_tokens,
        elapsed_ms=event.elapsed_ms,
        attempt=event.attempt,
        error=event.error,
        prefix_id=event.prefix_id,
    )
