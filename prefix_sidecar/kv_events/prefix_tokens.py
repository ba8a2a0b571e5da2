"""The token ids of each registered prefix, from a pod's POST /tokenize, handed to the
residency (its block keys are made from token ids, as the pods' BlockStored events carry).

One background task, woken on a registration or a membership change; a prefix is asked
once (ATTEMPTS tries), its answer bounded in bytes and checked before use.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence

from prefix_sidecar.kv_events.residency import Residency
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError

logger = logging.getLogger(__name__)

ATTEMPTS = 3
TIMEOUT_S = 10.0
PARSE_INLINE_BYTES = 256 * 1024  # json.loads of more runs off the loop


class PrefixTokens:
    def __init__(
        self,
        store: PrefixStore,
        client: UpstreamClient,
        residency: Residency,
        pods: Callable[[], Sequence[str]],
        *,
        model: str = "",
    ) -> None:
        self.store, self.client, self.residency, self.pods = store, client, residency, pods
        self.model = model
        self.watched: set[str] = set()
        self.failures: dict[str, int] = {}
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.watch_all()

    async def watch_all(self) -> None:
        entries = list(self.store)
        live = {entry.id for entry in entries}
        for gone in self.watched - live:
            self.residency.forget_prefix(gone)
        self.watched &= live
        self.failures = {k: v for k, v in self.failures.items() if k in live}
        for entry in entries:
            if entry.id in self.watched or self.failures.get(entry.id, 0) >= ATTEMPTS:
                continue
            pods = self.pods()
            if not pods:
                return  # woken again when pods are there
            try:
                tokens = await self.token_ids(pods[0], entry.text)
            except (UpstreamError, ValueError) as exc:
                self.failures[entry.id] = self.failures.get(entry.id, 0) + 1
                logger.info("prefix %s: no token ids for its residency (%s)", entry.name, exc)
                continue
            if self.store.has_id(entry.id):
                self.residency.watch_prefix(entry.id, tokens)
                self.watched.add(entry.id)

    async def token_ids(self, url: str, text: str) -> list[int]:
        size = len(text.encode())
        limit = 16 * size + 64 * 1024  # an id is <= 7 bytes of JSON and a token >= 1 byte
        body = {"model": self.model, "prompt": text} if self.model else {"prompt": text}
        answer = await self.client.fetch(
            "POST",
            url,
            "/tokenize",
            timeout_s=TIMEOUT_S,
            limit=limit,
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        if answer.status != 200 or answer.body is None:
            raise ValueError(f"HTTP {answer.status} (or over {limit} bytes)")
        raw = answer.body
        data = (
            json.loads(raw)
            if len(raw) <= PARSE_INLINE_BYTES
            else await asyncio.to_thread(json.loads, raw)
        )
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or len(tokens) > size + 8:
            raise ValueError("no token ids in the answer")
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens
        ):
            raise ValueError("the token ids are not ids")
        return tokens
