"""Assemble and run one sidecar: store, pool, health, router, relay, prewarm, gRPC server.

Shape after hypercorn's `serve(config, shutdown_trigger=...)`: the shutdown trigger is
injectable, so tests stop a sidecar without signals. On shutdown, health turns NOT_SERVING
first (probes and clients stop sending), new calls are refused, streams get `grace_s` to
finish, then the upstream session closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from prefix_sidecar.config import Config
from prefix_sidecar.hostport import split_host_port
from prefix_sidecar.lifecycle import AsyncService
from prefix_sidecar.membership.health import HealthMonitor
from prefix_sidecar.membership.load_signals import LoadSignals, MetricsPoller, poller, rules
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.membership.sources import (
    CombinedSource,
    DnsSource,
    FileSource,
    Member,
    MembershipError,
    MembershipSource,
    StaticSource,
    parse_dns_target,
)
from prefix_sidecar.metrics import Metrics, OrganicState, PodLoads, start_metrics_server
from prefix_sidecar.prefixes import PrefixError, PrefixStore
from prefix_sidecar.prewarm import WARMED, Prewarmer
from prefix_sidecar.routing import placement
from prefix_sidecar.routing.router import Router
from prefix_sidecar.routing.table import RoutingTable
from prefix_sidecar.server.common import memory
from prefix_sidecar.server.common.probes import Readiness, probe_routes
from prefix_sidecar.server.common.unix_socket import (
    SocketIdentity,
    apply_socket_permissions,
    prepare_socket_path,
    remove_own_socket,
    restrictive_umask,
    socket_identity,
)
from prefix_sidecar.server.grpc.handlers import SERVICE, add_router_servicer
from prefix_sidecar.server.grpc.servicer import RouterServicer
from prefix_sidecar.server.openai.front import OpenAIFront
from prefix_sidecar.upstream import caller
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.relay import Relay, RelayPolicy
from prefix_sidecar.upstream.tokenize import PrefixSizer
from prefix_sidecar.v1 import router_pb2

logger = logging.getLogger(__name__)


class Sidecar(AsyncService):
    """One running sidecar. `async with Sidecar(config) as sidecar:` starts and stops it."""

    def __init__(self, config: Config, policy: str | None = None) -> None:
        self.config = config
        self.metrics = Metrics(config.price_base, config.price_cache, config.price_out)
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
            # A request that waited for a pod connection is not sent if its caller left.
            trace_configs=[caller.trace_config()],
            load_observer=self.signals,
        )
        self.pool = BackendPool(
            hash_table=config.hash_table,
            warm_before_serve=config.warm_before_serve,
            needs_warming=lambda: len(self.store) > 0,
            on_warm_needed=self._warm_joiner,
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
        self.health: HealthMonitor | None = None
        self.poller: MetricsPoller | None = None
        self.sizer: PrefixSizer | None = None  # prefix sizes from a pod's POST /tokenize
        self._health_session: aiohttp.ClientSession | None = None
        self.server: grpc.aio.Server | None = None
        self.openai: OpenAIFront | None = None  # the HTTP front, when openai_listen is set
        self.health_servicer = health_aio.HealthServicer()
        self.readiness = Readiness()  # /readyz on the metrics port
        self._tasks: list[asyncio.Task[None]] = []
        self._warming: dict[str, asyncio.Task[None]] = {}
        self._metrics_runner: object | None = None
        self.tcp_port: int | None = None
        self.metrics_port: int | None = None
        self._socket_identity: SocketIdentity | None = None  # the socket file we bound

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
        file) releases what it opened - server, sessions, socket file, tasks - and raises."""
        try:
            await self._start()
        except BaseException:
            await self.stop(grace_s=0)
            raise

    async def _start(self) -> None:
        self._load_prefixes()
        source = self._membership_source()
        # Before anything that needs closing: a refused path must not leak a session.
        prepare_socket_path(self.socket_path)
        # Health checks get their own session: a pool full of request streams must not
        # queue them, or a busy pod would look dead.
        self._health_session = aiohttp.ClientSession()
        self.health = HealthMonitor(
            self._health_session,
            path=self.config.health_path,
            interval_s=self.config.health_interval_s,
            timeout_s=self.config.health_timeout_s,
            failure_threshold=self.config.eject_after_failures,
            on_change=self.pool.set_health,
        )
        self.server = self._grpc_server()
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
        add_router_servicer(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health_servicer, self.server)
        reflection.enable_server_reflection(
            (
                SERVICE,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        with restrictive_umask(self.config.socket_mode):
            self.server.add_insecure_port(self.target)
            self._socket_identity = socket_identity(self.socket_path)
            self._add_tcp_port(self.server)
            await self.server.start()
        apply_socket_permissions(
            self.socket_path, self.config.socket_mode, self.config.socket_group
        )
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
        try:
            first = await source.resolve()
        except MembershipError as exc:
            logger.error("initial membership failed (will keep trying): %s", exc)
            first = []
        if first:
            self._set_members(first)
        self._tasks.append(asyncio.create_task(source.watch(self._set_members), name="membership"))
        self._tasks.append(asyncio.create_task(self.health.run(), name="health"))
        self.sizer = PrefixSizer(
            self.store,
            self._health_session,
            lambda: sorted(url for url, b in self.pool.backends.items() if b.healthy),
            model=self.config.model,
        )
        self.store.watch(self.sizer.wake)
        self.sizer.wake()
        self._tasks.append(asyncio.create_task(self.sizer.run(), name="prefix-sizer"))
        if self.signals is not None and poller.POLL_SAMPLE > 0:
            self.poller = MetricsPoller(
                self.signals,
                self._health_session,
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
        tasks = [*self._tasks, *self._warming.values()]
        self._tasks.clear()
        self._warming.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.health is not None:
            self.health.close()
        if self._metrics_runner is not None:
            runner, self._metrics_runner = self._metrics_runner, None
            await runner.cleanup()  # type: ignore[attr-defined]
        await self.client.close()
        if self._health_session is not None:
            await self._health_session.close()
        # grpc unlinks the path when it stops listening, and a sidecar started since then may
        # have bound it again (an overlapping restart): remove only the file this one bound.
        remove_own_socket(self.socket_path, self._socket_identity)
        self._socket_identity = None
        logger.info("prefix-sidecar stopped")

    # --- wiring -------------------------------------------------------------------------

    def _grpc_server(self) -> grpc.aio.Server:
        size = self.config.max_message_bytes
        return grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", size),
                ("grpc.max_send_message_length", size),
                ("grpc.so_reuseport", 0),
                # Hostile-caller limits (issue 11), measured with `prefix-sidecar attack`.
                # HTTP/2 rapid reset: every HEADERS+RST_STREAM still becomes a call that
                # waits in grpc core's pending queue (~30 KB each) until Python takes it;
                # the old 100,000 pending let RSS grow to 2 GB. grpc counts a reset stream
                # against max_concurrent_streams until its call is freed, so one connection
                # holds at most 4,096 of them. Lower caps refuse a legitimate caller's
                # streams (RST_STREAM REFUSED_STREAM, UNAVAILABLE to it): a 2,500-call burst
                # on one channel must pass, and at 256 or 1,024 it did not.
                ("grpc.max_concurrent_streams", 4096),
                # 5,000 pending calls bound the queue at ~150 MB (soft = hard: nothing is
                # shed at random below it). A call unrequested for 10 s is dropped in C,
                # without costing Python. Not less: on a loaded 2-core box Python takes a
                # legitimate 2,500-call burst in seconds, and at 1 s most of it was CANCELLED.
                ("grpc.server.max_pending_requests", 5_000),
                ("grpc.server.max_pending_requests_hard_limit", 5_000),
                ("grpc.server_max_unrequested_time_in_server", 10),
                # A caller's metadata: grpc's defaults, pinned (8 KiB soft, 16 KiB hard). A
                # CONTINUATION flood is cut at the hard limit.
                ("grpc.max_metadata_size", 8 * 1024),
                ("grpc.absolute_max_metadata_size", 16 * 1024),
                # A connection that never sends its preface holds an fd for 120 s by
                # default; a local caller needs milliseconds.
                ("grpc.server_handshake_timeout_ms", 20_000),
                # Every connection holds an fd and ~40 KB of buffers: a local process opening
                # them by the thousand must meet a bound before the fd limit (the image's
                # nofile is 20,000). A sidecar's callers need a handful each.
                ("grpc.max_allowed_incoming_connections", 4096),
                # Connections with no call for 10 minutes are closed (clients reconnect);
                # ping abuse keeps grpc's default of 2 strikes.
                ("grpc.max_connection_idle_ms", 600_000),
            ]
        )

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

    def _add_tcp_port(self, server: grpc.aio.Server) -> None:
        config = self.config
        if not config.tcp_listen:
            return
        key = Path(config.tls_key_file).read_bytes()
        cert = Path(config.tls_cert_file).read_bytes()
        client_ca = (
            Path(config.tls_client_ca_file).read_bytes() if config.tls_client_ca_file else None
        )
        credentials = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )
        self.tcp_port = server.add_secure_port(config.tcp_listen, credentials)

    def _membership_source(self) -> MembershipSource:
        config = self.config
        sources: list[MembershipSource] = []
        allow_special = config.allow_special_backend_addresses
        if config.backends:
            members = [Member(url, weight) for url, weight in config.backends]
            sources.append(StaticSource(members, allow_special=allow_special))
        if config.backends_file:
            sources.append(FileSource(config.backends_file, config.file_interval_s, allow_special))
        if config.backends_dns:
            name, port = parse_dns_target(config.backends_dns)
            nameserver, nameserver_port = None, 53
            if config.dns_nameserver:
                nameserver, nameserver_port = split_host_port(
                    config.dns_nameserver, default_port=53
                )
            sources.append(
                DnsSource(
                    name,
                    port,
                    interval_s=config.dns_interval_s,
                    nameserver=nameserver,
                    nameserver_port=nameserver_port,
                    allow_special=allow_special,
                )
            )
        if not sources:
            raise ValueError(
                "no backends configured: give --backend URL, --backends-file or --backends-dns"
            )
        return sources[0] if len(sources) == 1 else CombinedSource(sources)

    def _load_prefixes(self) -> None:
        for spec in self.config.prefixes:
            try:
                text = Path(spec.file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"prefix {spec.name!r}: cannot read {spec.file}: {exc}") from None
            try:
                entry, _ = self.store.register(spec.name, text, spec.replicas)
            except PrefixError as exc:
                raise ValueError(f"prefix {spec.name!r} from {spec.file}: {exc}") from None
            logger.info("prefix %s loaded from %s (%s)", spec.name, spec.file, entry.id[:12])

    def _set_members(self, members: list[Member]) -> None:
        self.pool.set_members(members)
        if self.signals is not None:
            self.signals.set_members(m.url for m in members)
        # Pod IPs change on every rollout: drop every series of the pods that left (an
        # in-flight gauge of a stream still running stays until it ends, see Metrics._drop).
        self.metrics.forget_backends()
        if self.health is not None:
            self.health.set_members([m.url for m in members])

    def _pod_loads(self) -> PodLoads:
        backends = self.pool.backends.values()
        loads = {b.url: (b.load, b.reported_load) for b in backends}
        return PodLoads(loads, self.pool.fleet_scale)

    def _over_cap_load(self, url: str) -> int | None:
        """The smallest load that puts `url` over its bounded-load cap (routing contract
        section 4) on the current table, counting that the report itself joins the total:
        v with v + 1 > max(min_cap, ceil(c (L - e + v + 1) s)), e being the pod's load in the
        table and s its weight share; the smallest, so that the others' caps grow least.
        None when no load can (c s >= 1: one pod, or c >= the pod count)."""
        table = self.pool.table
        index = table.index.get(url)
        if index is None or table.ring is None:
            return None
        ring = table.ring
        share = self.config.load_factor * float(ring.weights[index]) / float(ring.total_weight)
        if share >= 1.0:
            return None
        others = table.total - table.loads[index] + 1
        return max(self.config.load_cap_floor, math.ceil(share * others / (1.0 - share)))

    def _pods_kv_changed(self, kv_tokens: int | None) -> None:
        """The pods' agreed KV size changed: with no configured budget (the override), the
        budget is that size x HOME_KV_FRACTION (docs/load-signals.md)."""
        if self.config.home_kv_budget_tokens or not placement.HOME_KV_FRACTION:
            return
        budget = int(kv_tokens * placement.HOME_KV_FRACTION) if kv_tokens else 0
        logger.info("home KV budget from the pods: %d tokens (pods' KV %s)", budget, kv_tokens)
        self.router.set_kv_budget(budget)

    def _table_changed(self, table: RoutingTable) -> None:
        if self.sizer is not None:
            self.sizer.wake()  # a pod became healthy: prefixes not yet counted can be
        self.readiness.observe(backend.state for backend in self.pool.backends.values())
        for backend in self.pool.backends.values():
            self.metrics.set_backend(backend.url, backend.state, backend.healthy)

    def _warm_joiner(self, url: str) -> None:
        """Warm before serve: prewarm what a (re)joining pod is home for, then admit it."""
        previous = self._warming.pop(url, None)
        if previous is not None:
            previous.cancel()
        self._warming[url] = asyncio.get_running_loop().create_task(self._warm_then_admit(url))

    async def _warm_then_admit(self, url: str) -> None:
        pairs = [(entry, url) for entry in self.store if url in self.router.home_set(entry)]
        warmed = []
        if pairs:
            logger.info("warming %s with %d prefix(es) before it serves", url, len(pairs))
            for event in await self.prewarmer.warm_all(pairs):
                self.metrics.child(self.metrics.prewarm, url, event.state.lower()).inc()
                if event.state != WARMED:
                    # A pod that cannot be warmed still serves, cold: losing capacity at
                    # peak is worse than one slow first request.
                    logger.warning("backend %s serves cold: its prewarm failed", url)
                    logger.debug("backend %s prewarm error: %s", url, event.error)
                elif self.store.has_id(event.prefix_id):
                    # A prefix unregistered while it warmed is not reported warm.
                    warmed.append(event.prefix_id)
        self._warming.pop(url, None)
        self.pool.mark_warm(url, warmed)


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


__all__ = ["Sidecar", "router_pb2", "serve"]
