"""GET /v1/models on the HTTP front: every pool's models, as the pods list them.

A pool lists what one of its serving pods lists (vLLM's entries: the model, its LoRA
adapters, max_model_len), then each configured name the pod lacks (an alias); with no pod
answering, its configured names alone. Without `pools` in the config the pod's answer is
relayed as written. Pod answers are untrusted: read through the client's bounded fetch, at
most MAX_ENTRIES entries with a string id kept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prefix_sidecar.membership.pool import SERVING
from prefix_sidecar.server.model_pool import ModelPool
from prefix_sidecar.upstream.client import Fetched
from prefix_sidecar.upstream.errors import UpstreamError

TIMEOUT_S = 5.0
MAX_BYTES = 256 * 1024
MAX_ENTRIES = 1000
# Pods of one pool asked in turn before its configured names stand alone.
PODS_ASKED = 3


async def pod_models(pool: ModelPool, headers: Mapping[str, str]) -> tuple[str, Fetched] | None:
    """A serving pod of the pool and its /v1/models answer (a 2xx or a 401, the caller's
    key refused); None when no pod answered with one."""
    serving = [b.url for b in pool.pool.backends.values() if b.state == SERVING]
    for backend in serving[:PODS_ASKED]:
        try:
            answer = await pool.client.fetch(
                "GET", backend, "/v1/models", timeout_s=TIMEOUT_S, limit=MAX_BYTES, headers=headers
            )
        except UpstreamError:
            continue
        if (answer.status < 300 or answer.status == 401) and answer.body is not None:
            return backend, answer
    return None


def pool_entries(pool: ModelPool, answer: Fetched | None) -> list[dict[str, Any]]:
    """The pool's entries: its pod's (bounded), then its configured names the pod lacks."""
    entries: list[dict[str, Any]] = []
    if answer is not None and answer.status < 300 and answer.body is not None:
        try:
            listed = json.loads(answer.body).get("data")
        except (ValueError, AttributeError, RecursionError):
            listed = None
        if isinstance(listed, list):
            entries = [
                item
                for item in listed[:MAX_ENTRIES]
                if isinstance(item, dict) and isinstance(item.get("id"), str)
            ]
    ids = {item["id"] for item in entries}
    entries.extend(
        {"id": name, "object": "model", "owned_by": "prefix-sidecar", "root": pool.models[0]}
        for name in pool.models
        if name not in ids
    )
    return entries


def models_body(pools: list[tuple[ModelPool, Fetched | None]]) -> bytes:
    """OpenAI's list of every pool's entries, each id once (the first pool's wins)."""
    data: list[dict[str, Any]] = []
    seen: set[str] = set()
    for pool, answer in pools:
        for item in pool_entries(pool, answer):
            if item["id"] not in seen:
                seen.add(item["id"])
                data.append(item)
    return json.dumps({"object": "list", "data": data}).encode()
