"""The sidecar.v1.Router servicer. Each RPC checks its request (validation.py) and routes it
(plan.py); Complete and Chat relay the pod's answer (stream.py); the rest answer here.

A refusal is an RpcAbort, turned into a gRPC status a client can branch on with a message that
says what to fix (docs/api.md). No exception escapes as UNKNOWN: an unexpected bug is logged
and answered INTERNAL, and the sidecar keeps serving.
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
from prefix_sidecar.metrics import FRONT_GRPC, Metrics
from prefix_sidecar.prefixes import PrefixEntry, PrefixError, PrefixNotFound
from prefix_sidecar.prewarm import WarmEvent
from prefix_sidecar.server.grpc.plan import Planner
from prefix_sidecar.server.grpc.stream import stream_reply
from prefix_sidecar.server.grpc.validation import registration_text
from prefix_sidecar.server.model_pool import ModelPool
from prefix_sidecar.server.pools import Pools, UnknownModel
from prefix_sidecar.server.warm_before_serve import note_prewarm
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
    pools: Pools
    metrics: Metrics
    _planners: dict[str, Planner] = field(init=False)

    def __post_init__(self) -> None:
        several = len(self.pools) > 1
        self._planners = {pool.name: Planner(pool, several) for pool in self.pools}

    def _pool(self, model: str) -> ModelPool:
        """The pool of a request's model; NOT_FOUND, naming the models served, when none."""
        try:
            return self.pools.for_model(model)
        except UnknownModel as exc:
            raise RpcAbort(grpc.StatusCode.NOT_FOUND, str(exc)) from None

    def _planner(self, model: str) -> Planner:
        return self._planners[self._pool(model).name]

    # --- prefixes -----------------------------------------------------------------------

    @_status_on_error
    async def RegisterPrefix(
        self, request: router_pb2.RegisterPrefixRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.Prefix:
        text = registration_text(request, self.config.max_prefix_bytes)
        pool = self._pool(request.model)
        scope = self._planners[pool.name].scope(request)
        try:
            entry, created = pool.store.register(request.name, text, request.replicas, scope)
        except PrefixError as exc:
            raise invalid_argument(str(exc)) from None
        logger.info(
            "prefix %s registered in pool %s as %s (%d bytes, %s)",
            request.name,
            pool.name,
            entry.id[:12],
            entry.size,
            "new" if created else "already known",
        )
        if not request.prewarm:
            return self._prefix_message(pool, request.name, entry)
        # Warm where the prefix will live: after its count (a count moves homes), and settle
        # moved homes before answering, so traffic sent on WARMED waits behind no prewarm.
        await pool.counted()
        reply = self._prefix_message(pool, request.name, entry)
        targets = pool.router.home_set(entry)
        if not targets:
            raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "no pod to prewarm on: none is up")
        for event in await pool.prewarmer.warm_all([(entry, url) for url in targets]):
            note_prewarm(event, pool.store, pool.pool, self.metrics)
            reply.prewarm.append(_event_message(event))
        await pool.new_homes.settle()
        return reply

    @_status_on_error
    async def UnregisterPrefix(
        self, request: router_pb2.UnregisterPrefixRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.UnregisterPrefixReply:
        which = request.WhichOneof("prefix")
        pool = self._pool(request.model)
        store = pool.store
        try:
            if which == "prefix_id":
                names = store.names_of(request.prefix_id)
                removed = store.unregister_id(request.prefix_id)
            elif which == "prefix_name":
                names = (request.prefix_name,)
                removed = store.unregister_name(request.prefix_name)
            else:
                raise invalid_argument("set prefix_id or prefix_name to unregister")
        except PrefixNotFound as exc:
            raise RpcAbort(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        for prefix_id in removed:
            pool.pool.forget_prefix(prefix_id)
        # The token series of every name that no longer points at a text in any pool.
        for name in names:
            if not any(other.store.has_name(name) for other in self.pools):
                self.metrics.forget_prefix(name)
        return router_pb2.UnregisterPrefixReply(removed_ids=removed)

    @_status_on_error
    async def ListPrefixes(
        self, request: router_pb2.ListPrefixesRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListPrefixesReply:
        # One item per pool, name and version: a text under two names, or in two pools, is
        # listed twice.
        return router_pb2.ListPrefixesReply(
            prefixes=[
                self._prefix_message(pool, name, entry)
                for pool in self.pools
                for name, entry in pool.store.named()
            ]
        )

    @staticmethod
    def _prefix_message(pool: ModelPool, name: str, entry: PrefixEntry) -> router_pb2.Prefix:
        return router_pb2.Prefix(
            id=entry.id,
            name=name,
            bytes=entry.size,
            route_key=entry.route_key,
            replicas=pool.router.replicas_of(entry),
            backends=pool.router.home_set(entry),
            versions=pool.store.versions(name),
            pool=pool.name,
            adapter=entry.scope.adapter,
            salted=bool(entry.scope.salt),
        )

    # --- routing ------------------------------------------------------------------------

    @_status_on_error
    async def Route(
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteReply:
        planner = self._planner(request.model)
        decision = planner.route(request)
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
            pool=planner.pool,
        )

    # --- streaming (stream.py) --------------------------------------------------------

    async def Complete(
        self, request: router_pb2.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await stream_reply("Complete", self._planner, request, context, self.metrics)

    async def Chat(
        self, request: router_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await stream_reply("Chat", self._planner, request, context, self.metrics)

    # --- prewarm and backends -----------------------------------------------------------

    async def Prewarm(
        self, request: router_pb2.PrewarmRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.PrewarmEvent]:
        try:
            pool = self._pool(request.model)
            entry = self._planners[pool.name].entry(request, request.WhichOneof("prefix"))
            if entry is None:
                raise invalid_argument("set prefix_id or prefix_name")
            if request.all_backends:
                targets = [b.url for b in pool.pool.backends.values() if b.healthy is not False]
            else:
                targets = pool.router.home_set(entry)
            if not targets:
                raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "no pod to prewarm on: none is up")
        except RpcAbort as exc:
            await context.abort(exc.code, exc.message)
            return
        async for event in pool.prewarmer.run([(entry, url) for url in targets]):
            note_prewarm(event, pool.store, pool.pool, self.metrics)
            yield _event_message(event)

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
                pool=pool.name,
                adapters=sorted(pool.adapters.of(b.url)),
            )
            for pool in self.pools
            for b in sorted(pool.pool.backends.values(), key=lambda b: b.url)
        ]
        generation = sum(pool.pool.table.generation for pool in self.pools)
        return router_pb2.ListBackendsReply(backends=backends, generation=generation)


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
