"""The sidecar.v1.Router servicer: the RPCs. Each checks its request (validation.py) and
routes it (plan.py); Complete and Chat then relay the pod's answer and record the outcome
(stream.py); the prefix, prewarm and backend RPCs answer here.

Every refusal carries a gRPC status a client can branch on and a message that says what
to fix (docs/api.md lists them): code below raises RpcAbort, the RPC turns it into its
status. Handlers never let an exception escape as UNKNOWN: an unexpected bug is logged and
reported as INTERNAL, and the sidecar keeps serving.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from prefix_sidecar.abort import RpcAbort, invalid_argument
from prefix_sidecar.config import Config
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.metrics import FRONT_GRPC, Metrics
from prefix_sidecar.prefixes import PrefixEntry, PrefixError, PrefixNotFound, PrefixStore
from prefix_sidecar.prewarm import FAILED, WARMED, Prewarmer, WarmEvent
from prefix_sidecar.routing.router import Router
from prefix_sidecar.server.grpc.plan import Planner
from prefix_sidecar.server.grpc.stream import stream_reply
from prefix_sidecar.server.grpc.validation import registration_text
from prefix_sidecar.upstream.relay import Relay
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger("sidecar.requests")

T = TypeVar("T")


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


@dataclass(eq=False)
class RouterServicer(router_pb2_grpc.RouterServicer):
    config: Config
    store: PrefixStore
    pool: BackendPool
    router: Router
    relay: Relay
    prewarmer: Prewarmer
    metrics: Metrics
    plans: Planner = field(init=False)

    def __post_init__(self) -> None:
        self.plans = Planner(self.config, self.store, self.router)

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
        decision = self.plans.route(request)
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

    # --- streaming (stream.py) --------------------------------------------------------

    async def Complete(
        self, request: router_pb2.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await stream_reply(
            "Complete",
            self.plans.completion,
            request,
            context,
            self.relay,
            self.metrics,
            self.plans.refined,
        )

    async def Chat(
        self, request: router_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await stream_reply(
            "Chat", self.plans.chat, request, context, self.relay, self.metrics, self.plans.refined
        )

    # --- prewarm and backends -----------------------------------------------------------

    async def Prewarm(
        self, request: router_pb2.PrewarmRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.PrewarmEvent]:
        try:
            which = request.WhichOneof("prefix")
            if which == "prefix_id":
                entry = self.plans.by_id(request.prefix_id)
            elif which == "prefix_name":
                entry = self.plans.by_name(request.prefix_name)
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
