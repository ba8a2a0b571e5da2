"""One pool of a sidecar: one model's pods and everything that routes to them.

A pool (config `pools`, prefix_sidecar/config/pools.py) owns its prefix store, backend pool
and ring, router, health checks, load signals, prewarm, warm-before-serve, prefix sizing,
KV-event following, relay, and a pod client with its own per-pod connection budget; it shares
the sidecar's metrics, fronts and process. Built from its own config (the top level with the
pool's keys), it routes exactly as a one-pool sidecar with that config would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from prefix_sidecar.config import Config
from prefix_sidecar.config.pools import PoolSpec
from prefix_sidecar.hostport import split_host_port
from prefix_sidecar.kv_events.follow import KvEventsFollow
from prefix_sidecar.kv_events.residency import Residency
from prefix_sidecar.kv_index.lookup import IndexLookup, attach_index
from prefix_sidecar.membership.adapters import AdapterWatch
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
from prefix_sidecar.metrics import Metrics, OrganicState, PoolState
from prefix_sidecar.prefixes import PrefixError, PrefixStore
from prefix_sidecar.prewarm import Prewarmer
from prefix_sidecar.routing import placement
from prefix_sidecar.routing.cost import REQUEST_CAP_FLOOR, floor_units
from prefix_sidecar.routing.router import Router
from prefix_sidecar.routing.table import RoutingTable
from prefix_sidecar.server.warm_before_serve import JoinerWarmup, NewHomeWarmup
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.relay import Relay, RelayPolicy
from prefix_sidecar.upstream.tokenize import PrefixSizer

logger = logging.getLogger(__name__)

# How long a registration waits for its prefix's count before it prewarms: the sizer's own
# timeout per attempt (a /tokenize of an 80k-token prefix took ~0.1 s on a vLLM CPU pod).
COUNT_WAIT_S = 10.0


class ModelPool:
    """The parts of one pool: `load_prefixes`, then `start` its tasks; to stop, `take_tasks`
    (the caller cancels them), then `close`."""

    def __init__(
        self,
        spec: PoolSpec,
        config: Config,
        metrics: Metrics,
        on_table: Callable[[], None] = lambda: None,
    ) -> None:
        """`config`: the pool's own (config.pools.pool_configs); `on_table`: called after each
        change of this pool's routing table (the sidecar's readiness)."""
        self.name = spec.name
        self.models = spec.models
        self.config = config
        self.metrics = metrics
        self._on_table = on_table
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
            on_unasked=lambda url: metrics.child(metrics.unasked_bytes, url).inc(),
        )
        self.pool = BackendPool(
            hash_table=config.hash_table,
            warm_before_serve=config.warm_before_serve,
            load_unit=config.load_unit,
            needs_warming=lambda: len(self.store) > 0,
            on_warm_needed=lambda url: self.joiners(url),
        )
        self.pool.watch(self._table_changed)
        self.router = Router.from_config(self.pool, self.store, config)
        self.prewarmer = Prewarmer(self.client, model=config.model)
        self.joiners = JoinerWarmup(self.prewarmer, self.store, self.router, self.pool, metrics)
        self.new_homes = NewHomeWarmup(self.prewarmer, self.store, self.router, self.pool, metrics)
        self.health = HealthMonitor(
            self.client,
            path=config.health_path,
            interval_s=config.health_interval_s,
            timeout_s=config.health_timeout_s,
            failure_threshold=config.eject_after_failures,
            on_change=self.pool.set_health,
        )
        self.relay = Relay(
            self.client,
            self.pool,
            self.health,
            metrics,
            RelayPolicy(
                max_attempts=config.max_attempts,
                first_token_timeout_s=config.first_token_timeout_s,
                upstream_timeout_s=config.upstream_timeout_s,
                max_message_bytes=config.max_message_bytes,
            ),
        )
        self.poller: MetricsPoller | None = None
        self.sizer: PrefixSizer | None = None  # prefix sizes from a pod's POST /tokenize
        self.residency = Residency()  # fed by the pods' KV events when kv_events is on
        self.kv_events: KvEventsFollow | None = None
        self.kv_index: IndexLookup | None = None  # precise routing's, with kv_index_url
        # Which pod holds which LoRA adapter, from their /v1/models (membership/adapters.py).
        self.adapters = AdapterWatch(self.client)
        self.router.adapters = self.adapters
        self._tasks: list[asyncio.Task[None]] = []

    # --- what the sidecar reads ---------------------------------------------------------

    def adapter_of(self, model: str) -> str:
        """`model` when it names a LoRA adapter the pool's pods hold, else ""."""
        return model if model in self.adapters and model not in self.models else ""

    def pod_model(self, model: str) -> str:
        """The name the pods get for a request's model: the pool's first for an alias (as
        an llm-d InferenceModel rewrites its name), any other as the caller gave it."""
        return self.models[0] if model in self.models[1:] else model

    def scrape_state(self) -> PoolState:
        """What the metrics export of this pool at a scrape (metrics/scrape_time.py)."""
        backends = self.pool.backends.values()
        loads = {b.url: (b.load, b.reported_load) for b in backends}
        organic = self.router.organic
        return PoolState(
            self.name,
            self.router.homed_tokens(),
            self.router.placer.budget_tokens,
            loads,
            self.pool.fleet_scale,
            OrganicState(dict(organic.decisions), organic.table.sizes()) if organic else None,
        )

    async def counted(self) -> None:
        """Wait, at most COUNT_WAIT_S, until the registered prefixes are counted (or given up
        on): a count moves homes, so a prewarm before it may warm the wrong pods."""
        if self.sizer is not None:
            await self.sizer.idle(COUNT_WAIT_S)

    # --- lifecycle ----------------------------------------------------------------------

    def load_prefixes(self) -> None:
        """Register the prefixes the pool's config names (ValueError naming the file)."""
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

    async def start(self) -> None:
        """Follow the pool's pods: membership, health, KV events, sizes, load polls."""
        source = membership_source(self.config)
        if self.config.kv_events:
            self.router.residency = self.residency
            parts = (self.client, self.residency, self.store, self.pool, self.metrics)
            self.kv_events = KvEventsFollow(*parts, self.prewarmer, self.router, self.config)
            self._tasks.append(self.kv_events.start())
        self.kv_index = attach_index(self.router, self.client, self.metrics, self.config)
        try:
            first = await source.resolve()
        except MembershipError as exc:
            logger.error(
                "pool %s: initial membership failed (will keep trying): %s", self.name, exc
            )
            first = []
        if first:
            self._set_members(first)
        self._task(source.watch(self._set_members), "membership")
        self._task(self.health.run(), "health")
        self._task(self.adapters.run(), "adapters")
        # A pass runs as a task of its own, after every watcher (the router's placement too).
        self.pool.watch(lambda _table: self.new_homes())
        self.store.watch(self.new_homes)
        self._task(self.new_homes.run(), "new-home-warmup")
        self.sizer = sizer = PrefixSizer(
            self.store,
            self.client,
            lambda: sorted(url for url, b in self.pool.backends.items() if b.healthy),
            model=self.config.model,
        )
        self.store.watch(sizer.wake)
        sizer.idle_watchers.append(self.new_homes)
        self.new_homes.counting = lambda: sizer.busy
        sizer.wake()
        self._task(sizer.run(), "prefix-sizer")
        if self.signals is not None and poller.POLL_SAMPLE > 0:
            self.poller = MetricsPoller(
                self.signals,
                self.client,
                interval_s=poller.POLL_INTERVAL_S,
                sample=poller.POLL_SAMPLE,
                timeout_s=poller.POLL_TIMEOUT_S,
            )
            self._task(self.poller.run(), "load-poll")
        logger.info(
            "pool %s: models %s, backends from %s", self.name, self.models, source.description
        )

    def _task(self, work: object, name: str) -> None:
        self._tasks.append(asyncio.create_task(work, name=f"{self.name}:{name}"))  # type: ignore[arg-type]

    def take_tasks(self) -> list[asyncio.Task[None]]:
        """Every task still running, handed to the caller to cancel and await."""
        tasks = [*self._tasks, *self.joiners.take_tasks(), *self.new_homes.take_tasks()]
        self._tasks.clear()
        return tasks

    async def close(self) -> None:
        """After its tasks ended: the sockets and connections the pool opened."""
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.kv_index is not None:
            await self.kv_index.close()
        self.health.close()
        await self.client.close()

    # --- wiring -------------------------------------------------------------------------

    def _set_members(self, members: list[Member]) -> None:
        self.pool.set_members(members)
        if self.signals is not None:
            self.signals.set_members(m.url for m in members)
        # Pod IPs change on every rollout: drop the series of pods that left (a running
        # stream's in-flight gauge stays until it ends, see Metrics._drop).
        self.metrics.forget_backends()
        self.health.set_members([m.url for m in members])
        self.adapters.set_members(m.url for m in members)
        if self.kv_events is not None:
            self.kv_events.set_pods(m.url for m in members)

    def _over_cap_load(self, url: str) -> int | None:
        return self.pool.table.over_cap_load(
            url, self.config.load_factor, floor_units(self.config.load_unit, REQUEST_CAP_FLOOR)
        )

    def _pods_kv_changed(self, kv_tokens: int | None) -> None:
        """The pods' agreed KV size changed: unless a budget is configured, the home budget is
        that size x HOME_KV_FRACTION (docs/load-signals.md)."""
        if self.config.home_kv_budget_tokens or not placement.HOME_KV_FRACTION:
            return
        budget = int(kv_tokens * placement.HOME_KV_FRACTION) if kv_tokens else 0
        logger.info(
            "pool %s: home KV budget from the pods: %d tokens (pods' KV %s)",
            self.name,
            budget,
            kv_tokens,
        )
        self.router.set_kv_budget(budget)
        self.new_homes()

    def _table_changed(self, table: RoutingTable) -> None:
        if self.sizer is not None:
            self.sizer.wake()  # a pod may be healthy now: count what is still uncounted
        for backend in self.pool.backends.values():
            self.metrics.set_backend(backend.url, backend.state, backend.healthy)
        self._on_table()


def membership_source(config: Config) -> MembershipSource:
    """The static backends, the backends file and the DNS name, combined when several.

    It fails as ValueError with the field in the message, so a bad config stops the start with
    a line an operator can act on, before any socket or session is opened.
    """
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
            nameserver, nameserver_port = split_host_port(config.dns_nameserver, default_port=53)
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
