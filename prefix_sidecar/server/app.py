"""Assemble and run one sidecar: store, pool, health, router, relay, prewarm, gRPC server.

Shape after hypercorn's `serve(config, shutdown_trigger=...)`: the shutdown trigger is
injectable, so tests stop a sidecar without signals. On shutdown, health turns NOT_SERVING
first (probes and clients stop sending), new calls are refused, streams get `grace_s` to
finish, then the upstream client closes.

The parts come from their own modules: the gRPC server (server.grpc.server), the membership
source and prefix files (server.from_config), the warm-up of joining pods
(server.warm_before_serve), the pods' KV events (kv_events) and the shared index (kv_index).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from prefix_sidecar.config import Config
from prefix_sidecar.kv_events.follow import KvEventsFollow
from prefix_sidecar.kv_events.residency import Residency
from prefix_sidecar.kv_index.source import IndexSource, attach_index
from prefix_sidecar.lifecycle import AsyncService
from prefix_sidecar.membership.health import HealthMonitor
from prefix_sidecar.membership.load_signals import LoadSignals, MetricsPoller, poller, rules
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.membership.sources import Member, MembershipError
from prefix_sidecar.metrics import Metrics, OrganicState, PodLoads, Prices, start_metrics_server
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.prewarm import Prewarmer
from prefix_sidecar.routing import placement
from prefix_sidecar.routing.router import Router
from prefix_sidecar.routing.table import RoutingTable
from prefix_sidecar.server.common import connections, memory
from prefix_sidecar.server.common.probes import Readiness, probe_routes
from prefix_sidecar.server.common.unix_socket import SocketFile
from prefix_sidecar.server.from_config import load_prefixes, membership_source
from prefix_sidecar.server.grpc.handlers import SERVICE
from prefix_sidecar.server.grpc.server import add_services, add_tcp_port, grpc_server
from prefix_sidecar.server.grpc.servicer import RouterServicer
from prefix_sidecar.server.openai.front import OpenAIFront
from prefix_sidecar.server.warm_before_serve import JoinerWarmup, NewHomeWarmup
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.relay import Relay, RelayPolicy
from prefix_sidecar.upstream.tokenize import PrefixSizer

logger = logging.getLogger(__name__)


class Sidecar(AsyncService):
    """One running sidecar. `async with Sidecar(config) as sidecar:` starts and stops it."""

    def __init__(self, config: Config, policy: str | None = None) -> None:
        self.config = config
        self.metrics = Metrics(Prices(config.price_base, config.price_cache, config.price_out))
        self.store = PrefixStore(config.max_prefixes, config.max_prefix_bytes)
        # The pods' own load and KV (docs/load-signals.md); None = own in-flight only.
        self.signals = (
            LoadSignals(
                lambda url, load: self.pool.report_load(url, load),
                rules.LoadRule(rules.MAX_AGE_S, rules.KV_THRESHOLD),
                over_cap=self._over_cap_load if rules.REPORT_SATURATION else None,
                on_reading=(
                    (lambda url, load: self.pool.report_reading(url, load))
                    if rules.FLEET_VIEW and not rules.REPORT_SATURATION
                    else None
                ),
                on_kv=self._pods_kv_changed,
            )
            if config.load_signals
            else None
        )
        self.client = UpstreamClient(
            connect_timeout_s=config.connect_timeout_s,
            per_backend_connections=config.per_backend_connections,
            api_key=config.api_key(),
            load_observer=self.signals,
            on_unasked=lambda url: self.metrics.child(self.metrics.unasked_bytes, url).inc(),
        )
        self.pool = BackendPool(
            hash_table=config.hash_table,
            warm_before_serve=config.warm_before_serve,
            needs_warming=lambda: len(self.store) > 0,
            on_warm_needed=lambda url: self.joiners(url),
            on_change=self._table_changed,
        )
        self.router = Router.from_config(self.pool, self.store, config, policy)
        self.metrics.watch_home_tokens(
            self.router.homed_tokens, lambda: self.router.placer.budget_tokens
        )
        self.metrics.watch_pod_loads(self._pod_loads)
        organic = self.router.organic
        if organic is not None:
            self.metrics.watch_organic(
                lambda: OrganicState(dict(organic.decisions), organic.table.sizes())
            )
        self.metrics.track(lambda url: url in self.pool.backends, self.store.has_name)
        self.prewarmer = Prewarmer(
            self.client,
            model=config.model,
        )
        self.joiners = JoinerWarmup(
            self.prewarmer, self.store, self.router, self.pool, self.metrics
        )
        self.new_homes = NewHomeWarmup(
            self.prewarmer, self.store, self.router, self.pool, self.metrics
        )
        self.health: HealthMonitor | None = None
        self.poller: MetricsPoller | None = None
        self.sizer: PrefixSizer | None = None  # prefix sizes from a pod's POST /tokenize
        self.residency = Residency()  # fed by the pods' KV events when kv_events is on
        self.kv_events: KvEventsFollow | None = None
        self.kv_index: IndexSource | None = None  # precise routing's, with kv_index_url
        self.server: grpc.aio.Server | None = None
        self.openai: OpenAIFront | None = None  # the HTTP front, when openai_listen is set
        self.health_servicer = health_aio.HealthServicer()
        self.readiness = Readiness()  # /readyz on the metrics port
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_runner: object | None = None
        self.tcp_port: int | None = None
        self.metrics_port: int | None = None
        self.socket_file = SocketFile(config.socket_path, config.socket_mode, config.socket_group)

    @property
    def socket_path(self) -> str:
        return self.config.socket_path

    @property
    def target(self) -> str:
        """The gRPC target clients dial: unix:///path.sock."""
        return self.config.listen

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start everything; a start that fails half way (a metrics port in use, a bad TLS
        file) releases what it opened - server, client, socket file, tasks - and raises."""
        try:
            await self._start()
        except BaseException:
            await self.stop(grace_s=0)
            raise

    async def _start(self) -> None:
        load_prefixes(self.config, self.store)
        source = membership_source(self.config)
        # Before anything that needs closing: a refused path must not leak a session.
        self.socket_file.prepare()
        # Health checks go through the client's `fetch`, which does not wait for the
        # request budget: a pool full of request streams must not make a busy pod look dead.
        self.health = HealthMonitor(
            self.client,
            path=self.config.health_path,
            interval_s=self.config.health_interval_s,
            timeout_s=self.config.health_timeout_s,
            failure_threshold=self.config.eject_after_failures,
            on_change=self.pool.set_health,
        )
        connections.raise_fd_limit()  # before the fronts' caps are set from it
        self.server = grpc_server(self.config.max_message_bytes)
        self.relay = Relay(
            self.client,
            self.pool,
            self.health,
            self.metrics,
            RelayPolicy(
                max_attempts=self.config.max_attempts,
                first_token_timeout_s=self.config.first_token_timeout_s,
                upstream_timeout_s=self.config.upstream_timeout_s,
                max_message_bytes=self.config.max_message_bytes,
            ),
        )
        servicer = RouterServicer(
            self.config,
            self.store,
            self.pool,
            self.router,
            self.relay,
            self.prewarmer,
            self.metrics,
        )
        add_services(self.server, servicer, self.health_servicer)
        with self.socket_file.creating():
            self.server.add_insecure_port(self.target)
            self.socket_file.bound()
            self.tcp_port = add_tcp_port(self.server, self.config)
            await self.server.start()
        self.socket_file.secure()
        if self.config.metrics_port:
            runner = await start_metrics_server(
                self.metrics,
                self.config.metrics_host,
                self.config.metrics_port,
                probe_routes(self.readiness),
            )
            self._metrics_runner = runner
            self.metrics_port = self.config.metrics_port
        if self.config.openai_listen:
            await self._start_openai()
        if self.config.kv_events:
            self.router.residency = self.residency
            parts = (self.client, self.residency, self.store, self.pool, self.metrics)
            self.kv_events = KvEventsFollow(*parts, self.prewarmer, self.router, self.config)
            self._tasks.append(self.kv_events.start())
        self.kv_index = attach_index(self.router, self.client, self.metrics, self.config)
        try:
            first = await source.resolve()
        except MembershipError as exc:
            logger.error("initial membership failed (will keep trying): %s", exc)
            first = []
        if first:
            self._set_members(first)
        self._tasks.append(asyncio.create_task(source.watch(self._set_members), name="membership"))
        self._tasks.append(asyncio.create_task(self.health.run(), name="health"))
        # A pass runs as a task of its own, after every watcher (the router's placement too).
        self.pool.watch(lambda _table: self.new_homes())
        self.store.watch(self.new_homes)
        self._tasks.append(asyncio.create_task(self.new_homes.run(), name="new-home-warmup"))
        self.sizer = PrefixSizer(
            self.store,
            self.client,
            lambda: sorted(url for url, b in self.pool.backends.items() if b.healthy),
            model=self.config.model,
        )
        self.store.watch(self.sizer.wake)
        self.sizer.wake()
        self._tasks.append(asyncio.create_task(self.sizer.run(), name="prefix-sizer"))
        if self.signals is not None and poller.POLL_SAMPLE > 0:
            self.poller = MetricsPoller(
                self.signals,
                self.client,
                interval_s=poller.POLL_INTERVAL_S,
                sample=poller.POLL_SAMPLE,
                timeout_s=poller.POLL_TIMEOUT_S,
            )
            self._tasks.append(asyncio.create_task(self.poller.run(), name="load-poll"))
        # What an abusive burst allocated goes back to the OS once freed (rapid reset).
        self._tasks.append(asyncio.create_task(memory.trim_forever(), name="memory-trim"))
        for service in ("", SERVICE):
            await self.health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "prefix-sidecar listening on %s (%s); backends from %s",
            self.target,
            f"tcp {self.config.tcp_listen}" if self.config.tcp_listen else "no tcp",
            source.description,
        )

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain and release; safe after a partial start and when called again."""
        grace = self.config.grace_s if grace_s is None else grace_s
        self.readiness.drain()
        # Both doors drain at once: the shutdown takes one grace period, not two. The gRPC
        # server stops taking calls before health says NOT_SERVING (open calls such as that
        # Watch still finish), so a caller who acts on NOT_SERVING gets UNAVAILABLE, never a
        # call accepted and then cancelled by the stop.
        stopping = [asyncio.ensure_future(self.server.stop(grace))] if self.server else []
        if self.openai is not None:
            stopping.append(asyncio.ensure_future(self.openai.stop(grace)))
        await self.health_servicer.enter_graceful_shutdown()
        await asyncio.gather(*stopping)
        tasks = [*self._tasks, *self.joiners.take_tasks(), *self.new_homes.take_tasks()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.kv_index is not None:
            await self.kv_index.close()
        if self.health is not None:
            self.health.close()
        if self._metrics_runner is not None:
            runner, self._metrics_runner = self._metrics_runner, None
            await runner.cleanup()  # type: ignore[attr-defined]
        await self.client.close()
        # grpc unlinks the path when it stops listening, and a sidecar started since then may
        # have bound it again (an overlapping restart): remove only the file this one bound.
        self.socket_file.remove()
        logger.info("prefix-sidecar stopped")

    # --- wiring -------------------------------------------------------------------------

    async def _start_openai(self) -> None:
        self.openai = OpenAIFront(
            self.config,
            self.router,
            self.store,
            self.relay,
            self.pool,
            self.metrics,
            self.readiness,
            self.config.api_key(),
        )
        await self.openai.start()

    def _set_members(self, members: list[Member]) -> None:
        self.pool.set_members(members)
        if self.signals is not None:
            self.signals.set_members(m.url for m in members)
        # Pod IPs change on every rollout: drop every series of the pods that left (an
        # in-flight gauge of a stream still running stays until it ends, see Metrics._drop).
        self.metrics.forget_backends()
        if self.health is not None:
            self.health.set_members([m.url for m in members])
        if self.kv_events is not None:
            self.kv_events.set_pods(m.url for m in members)

    def _pod_loads(self) -> PodLoads:
        backends = self.pool.backends.values()
        loads = {b.url: (b.load, b.reported_load) for b in backends}
        return PodLoads(loads, self.pool.fleet_scale)

    def _over_cap_load(self, url: str) -> int | None:
        return self.pool.table.over_cap_load(
            url, self.config.load_factor, self.config.load_cap_floor
        )

    def _pods_kv_changed(self, kv_tokens: int | None) -> None:
        """The pods' agreed KV size changed: with no configured budget (the override), the
        budget is that size x HOME_KV_FRACTION (docs/load-signals.md)."""
        if self.config.home_kv_budget_tokens or not placement.HOME_KV_FRACTION:
            return
        budget = int(kv_tokens * placement.HOME_KV_FRACTION) if kv_tokens else 0
        logger.info("home KV budget from the pods: %d tokens (pods' KV %s)", budget, kv_tokens)
        self.router.set_kv_budget(budget)
        self.new_homes()

    def _table_changed(self, table: RoutingTable) -> None:
        if self.sizer is not None:
            self.sizer.wake()  # a pod became healthy: prefixes not yet counted can be
        self.readiness.observe(backend.state for backend in self.pool.backends.values())
        for backend in self.pool.backends.values():
            self.metrics.set_backend(backend.url, backend.state, backend.healthy)


# After SIGTERM the process is gone within grace_s + this, whatever is stuck.
SHUTDOWN_MARGIN_S = 5.0


def _exit_deadline(seconds: float) -> None:
    """End the process in `seconds` unless it exits by itself first.

    A thread, not a loop timer: what overruns may be the loop itself, or asyncio.run waiting
    for a thread stuck in a system call at exit. Daemonic, so a clean exit does not wait.
    """

    def expire() -> None:
        logger.error("shutdown did not finish within %.1f s of the signal: exiting now", seconds)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


async def serve(
    config: Config,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    policy: str | None = None,
    ready: Callable[[Sidecar], None] | None = None,
) -> None:
    """Run a sidecar until the trigger fires (default: SIGTERM or SIGINT)."""
    sidecar = Sidecar(config, policy=policy)
    await sidecar.start()
    # What start-up built (modules, descriptors, the prefixes) lives as long as the process:
    # out of the collector's reach, a full collection no longer walks it on the loop.
    gc.freeze()
    if ready is not None:
        ready(sidecar)
    try:
        if shutdown_trigger is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            logger.info("signal received: draining for up to %.1f s", config.grace_s)
            _exit_deadline(config.grace_s + SHUTDOWN_MARGIN_S)
        else:
            await shutdown_trigger()
    finally:
        await sidecar.stop()


__all__ = ["Sidecar", "serve"]
