"""Where a pod publishes its KV events: its `GET /kv_event_sources`, read and validated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

SOURCES_PATH = "/kv_event_sources"
SOURCES_TIMEOUT_S = 2.0
SOURCES_MAX_BYTES = 16 * 1024


class SourceError(Exception):
    pass


@dataclass(frozen=True)
class Source:
    endpoint: str
    replay_endpoint: str | None
    topic: bytes


def zmq_endpoint(value: object, pod_host: str) -> str:
    """`tcp://HOST:PORT` with a wildcard host read as the pod's own; only TCP, validated."""
    if not isinstance(value, str) or not value.startswith("tcp://") or len(value) > 300:
        raise SourceError("not a tcp:// endpoint")
    host, _, port = value[6:].rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise SourceError("no port in the endpoint")
    if host in ("*", "0.0.0.0", "::", "[::]"):
        host = f"[{pod_host}]" if ":" in pod_host else pod_host
    else:  # a concrete address makes the pod connect to its subscriber: not supported
        raise SourceError("the pod connects out (a concrete endpoint): bind it on tcp://*:PORT")
    return f"tcp://{host}:{int(port)}"


def parse_sources(body: bytes, pod_url: str) -> Source:
    """vLLM's `{rank: KVEventsConfig}`: rank 0's publisher (one per data-parallel rank)."""
    try:
        ranks = json.loads(body)
        config = ranks["0"] if "0" in ranks else ranks[0]
    except (ValueError, KeyError, TypeError, IndexError):
        raise SourceError("no rank 0 in the answer") from None
    if not isinstance(config, dict) or config.get("publisher") != "zmq":
        raise SourceError("KV events are not published over zmq")
    host = urlsplit(pod_url).hostname or "127.0.0.1"
    replay = config.get("replay_endpoint")
    topic = config.get("topic") or ""
    if not isinstance(topic, str) or len(topic) > 256:
        raise SourceError("bad topic")
    return Source(
        zmq_endpoint(config.get("endpoint"), host),
        None if replay is None else zmq_endpoint(replay, host),
        topic.encode(),
    )
