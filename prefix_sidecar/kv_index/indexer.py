"""`prefix-sidecar kv-indexer`: follow every pod's KV events and keep the shared block index
in Redis or Valkey (layout.py), for sidecars that query it (kv_index_url).

One indexer follows the pods it is given (a fleet too large for one is split by --backend
lists: each pod's fields are written by one indexer). Runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

from prefix_sidecar import logs
from prefix_sidecar.kv_events.subscriber import KvEventSubscriber
from prefix_sidecar.kv_index import layout
from prefix_sidecar.kv_index.writer import IndexWriter
from prefix_sidecar.lifecycle import stop_signal
from prefix_sidecar.membership.sources.members import canonical_backend_url
from prefix_sidecar.upstream.client import UpstreamClient

logger = logging.getLogger(__name__)

REDIS_SCHEMES = ("redis", "rediss", "unix")
REDIS_TIMEOUT_S = 2.0
REPORT_S = 60.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kv-indexer",
        help="keep the pods' KV blocks in a shared Redis index",
        description="Subscribe to every --backend's vLLM KV events and keep the shared "
        "block index in Redis or Valkey, which sidecars query with kv_index_url.",
    )
    parser.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL",
        help="a pod's base URL (repeat for each pod); its events endpoint comes from its "
        "GET /kv_event_sources",
    )
    parser.add_argument("--redis", required=True, metavar="URL", help="redis://HOST:PORT")
    parser.add_argument(
        "--namespace", default=layout.DEFAULT_NAMESPACE, help="prefix of every key written"
    )
    parser.add_argument("--log-level", default="info")
    parser.set_defaults(func=run)


def check_redis_url(url: str) -> str:
    """The URL, or ValueError saying what to fix."""
    parts = urlsplit(url)
    if parts.scheme not in REDIS_SCHEMES:
        raise ValueError(f"--redis {url!r}: expected redis://HOST:PORT (or rediss://, unix://)")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"--redis {url!r}: no host")
    return url


def check_backend(url: str) -> str:
    """The pod's canonical URL, the name every sidecar gives it (the index's keys carry it),
    or ValueError saying what to fix."""
    try:
        return canonical_backend_url(url)
    except ValueError as exc:
        raise ValueError(f"--backend: {exc}") from None


def run(args: argparse.Namespace) -> int:
    try:
        redis_url = check_redis_url(args.redis)
        backends = sorted({check_backend(url) for url in args.backend})
    except ValueError as exc:
        print(f"prefix-sidecar kv-indexer: {exc}", file=sys.stderr)
        return 2
    logs.configure(args.log_level.upper(), "text")
    asyncio.run(run_indexer(backends, redis_url, args.namespace))
    return 0


async def run_indexer(
    backends: Sequence[str], redis_url: str, namespace: str = layout.DEFAULT_NAMESPACE
) -> None:
    """Index `backends` until SIGTERM or SIGINT."""
    from redis.asyncio import Redis

    redis = Redis.from_url(
        redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
    )
    writer = IndexWriter(redis, namespace)
    async with UpstreamClient() as client:
        subscriber = KvEventSubscriber(client, writer)
        subscriber.set_pods(backends)
        tasks = [
            asyncio.create_task(writer.run(subscriber.catching_up), name="kv-index writer"),
            asyncio.create_task(_report(writer), name="kv-index report"),
        ]
        logger.info(
            "kv-indexer: %d pods into %s (namespace %r)", len(backends), redis_url, namespace
        )
        try:
            await stop_signal()
        finally:
            await subscriber.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await redis.aclose()


async def _report(writer: IndexWriter) -> None:
    while True:
        await asyncio.sleep(REPORT_S)
        blocks = sum(len(pod.engine) for pod in writer.pods.values())
        logger.info(
            "kv-indexer: %d pods known, %d blocks, %d commands written, %d queued",
            len(writer.pods),
            blocks,
            writer.written,
            len(writer.pending),
        )
