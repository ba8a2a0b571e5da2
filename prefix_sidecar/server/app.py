"""Assemble and run one sidecar: its pools (server.model_pool, looked up by server.pools),
the gRPC server (server.grpc.server), the HTTP front and the metrics.

The shutdown trigger is injectable, as in hypercorn's `serve`, so tests stop a sidecar without
signals. On shutdown /readyz turns 503, the fronts refuse new calls, health turns NOT_SERVING,
open streams get `grace_s` to finish, then the pools' tasks and clients close.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from prefix_sidecar.config import Config
from prefix_sidecar.config.pools import pool_configs
from prefix_sidecar.lifecycle import AsyncService, stop_signal
from prefix_sidecar.metrics import Metrics, start_metrics_server
from prefix_sidecar.server.common import connections, memory
from prefix_sidecar.server.common.probes import Readiness, probe_routes
from prefix_sidecar.server.common.unix_socket import SocketFile
from prefix_sidecar.server.grpc.handlers import SERVICE
from prefix_sidecar.server.grpc.server import add_services, add_tcp_port, grpc_server
from prefix_sidecar.server.grpc.servicer import RouterServicer
from prefix_sidecar.server.model_pool import ModelPool, membership_source
from prefix_sidecar.server.openai.front import OpenAIFront
from prefix_sidecar.server.pools import Pools

logger = logging.getLogger(__name__)


class Sidecar(AsyncService):
    """One running sidecar. `async with Sidecar(config) as sidecar:` starts and stops it."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics(config.prices)
        self.readiness = Readiness()  # /readyz on the metrics port
        self.pools = Pools(
            [
                ModelPool(spec, pool_config, self.metrics, self._table_changed)
                for spec, pool_config in pool_configs(config)
            ],
            any_model=not config.pools,
        )
        self.metrics.watch_pools(list(self.pools))
        self.metrics.track(
            lambda url: self.pools.serving(url) is not None,
            lambda name: any(pool.store.has_name(name) for pool in self.pools),
        )
        self.server: grpc.aio.Server | None = None
        self.openai: OpenAIFront | None = None  # the HTTP front, when openai_listen is set
        self.health_servicer = health_aio.HealthServicer()
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
        """Start everything; a failure half way releases what was opened, then raises."""
        try:
            await self._start()
        except BaseException:
            await self.stop(grace_s=0)
            raise

    async def _start(self) -> None:
        for pool in self.pools:
            pool.load_prefixes()
            membership_source(pool.config)  # a pool without pods fails here, before any socket
        # Before anything that needs closing: a refused path must not leak a session.
        self.socket_file.prepare()
        connections.raise_fd_limit()  # before the fronts' caps are set from it
        self.server = grpc_server(self.config.max_message_bytes)
        servicer = RouterServicer(self.config, self.pools, self.metrics)
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
            self.openai = OpenAIFront(
                self.config, self.pools, self.metrics, self.readiness, self.config.api_key()
            )
            await self.openai.start()
        for pool in self.pools:
            await pool.start()
            if pool.kv_events is not None:
                self.readiness.gate(pool.kv_events.subscriber.catching_up)
        # What an abusive burst allocated goes back to the OS once freed (rapid reset).
        self._tasks.append(asyncio.create_task(memory.trim_forever(), name="memory-trim"))
        for service in ("", SERVICE):
            await self.health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "prefix-sidecar listening on %s (%s); pools: %s",
            self.target,
            f"tcp {self.config.tcp_listen}" if self.config.tcp_listen else "no tcp",
            ", ".join(pool.name for pool in self.pools),
        )

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain and release; safe after a partial start and when called again."""
        grace = self.config.grace_s if grace_s is None else grace_s
        self.readiness.drain()
        # Both fronts drain at once: one grace period, not two. The gRPC server refuses new
        # calls before health says NOT_SERVING (open calls, a health Watch too, finish), so a
        # caller acting on NOT_SERVING gets UNAVAILABLE, never an accepted call then cancelled.
        stopping = [asyncio.ensure_future(self.server.stop(grace))] if self.server else []
        if self.openai is not None:
            stopping.append(asyncio.ensure_future(self.openai.stop(grace)))
        await self.health_servicer.enter_graceful_shutdown()
        await asyncio.gather(*stopping)
        tasks = [*self._tasks, *(task for pool in self.pools for task in pool.take_tasks())]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for pool in self.pools:
            await pool.close()
        if self._metrics_runner is not None:
            runner, self._metrics_runner = self._metrics_runner, None
            await runner.cleanup()  # type: ignore[attr-defined]
        # grpc unlinks the path on stop and an overlapping restart may have bound it again:
        # remove only the file this sidecar bound.
        self.socket_file.remove()
        logger.info("prefix-sidecar stopped")

    def _table_changed(self) -> None:
        """A pool's routing table changed (only from start on): refresh readiness from every
        pool's pods."""
        self.readiness.observe(
            backend.state for pool in self.pools for backend in pool.pool.backends.values()
        )


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
    ready: Callable[[Sidecar], None] | None = None,
) -> None:
    """Run a sidecar until the trigger fires (default: SIGTERM or SIGINT)."""
    sidecar = Sidecar(config)
    await sidecar.start()
    # What start-up built (modules, descriptors, prefixes) lives as long as the process:
    # frozen, a full collection does not walk it on the loop.
    gc.freeze()
    if ready is not None:
        ready(sidecar)
    try:
        if shutdown_trigger is None:
            await stop_signal()
            logger.info("signal received: draining for up to %.1f s", config.grace_s)
            _exit_deadline(config.grace_s + SHUTDOWN_MARGIN_S)
        else:
            await shutdown_trigger()
    finally:
        await sidecar.stop()


__all__ = ["Sidecar", "serve"]
