"""A prefix's size in tokens, counted once at registration by one pod's `POST /tokenize`.

The KV budget (routing contract section 6) places prefixes by KV size, which bytes can misjudge
by 2x (CJK ~1.5 bytes a token, English ~4). The count is kept on `PrefixEntry.tokens`; without
an answer the bytes estimate stays. vLLM's shape (`{"prompt"}` -> `{"count", "tokens", ...}`)
is tried first, then llama.cpp's (`{"content"}` -> `{"tokens": [...]}`; it answers vLLM's with
`{"tokens": []}`). The answer is untrusted: bounded in bytes and time, no redirect, a count in
1..bytes + SPECIAL_TOKENS_SLACK (a token covers >= 1 byte); a large body is parsed off-loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from prefix_sidecar.lifecycle import WokenPass
from prefix_sidecar.prefixes import PrefixEntry, PrefixStore
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError

logger = logging.getLogger(__name__)

SPECIAL_TOKENS_SLACK = 64
PARSE_INLINE_BYTES = 256 * 1024  # parsed inline below this (~2 ms), in a thread above
ATTEMPTS_PER_PREFIX = 3
JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


class TokenizeError(Exception):
    pass


def _max_answer_bytes(text_bytes: int) -> int:
    """A token id is at most 7 digits plus a comma, and a token covers at least one byte."""
    return 8 * (text_bytes + SPECIAL_TOKENS_SLACK) + 4096


def read_count(data: Any, text_bytes: int) -> int:
    """The token count from either shape; TokenizeError if absent or out of range."""
    if not isinstance(data, dict):
        raise TokenizeError("the answer is not a JSON object")
    count = data.get("count")
    if count is None and isinstance(data.get("tokens"), list):
        count = len(data["tokens"])
    if isinstance(count, bool) or not isinstance(count, int):
        raise TokenizeError("the answer has neither 'count' nor a 'tokens' list")
    if not 1 <= count <= text_bytes + SPECIAL_TOKENS_SLACK:
        raise TokenizeError(f"a count of {count} tokens for {text_bytes} bytes is not believable")
    return count


async def _post(
    client: UpstreamClient,
    url: str,
    path: str,
    body: dict[str, Any],
    timeout_s: float,
    limit: int,
) -> Any:
    try:
        answer = await client.fetch(
            "POST",
            url,
            path,
            timeout_s=timeout_s,
            limit=limit,
            body=json.dumps(body).encode(),
            headers=JSON_HEADERS,
        )
    except UpstreamError as exc:
        raise TokenizeError(exc.message) from None
    if answer.status != 200:
        raise TokenizeError(f"HTTP {answer.status}")
    raw = answer.body
    if raw is None:
        raise TokenizeError(f"the answer is over {limit} bytes")
    try:
        if len(raw) <= PARSE_INLINE_BYTES:
            return json.loads(raw)
        return await asyncio.to_thread(json.loads, raw)
    except (ValueError, RecursionError):
        raise TokenizeError("the answer is not JSON") from None


async def count_tokens(
    client: UpstreamClient,
    url: str,
    text: str,
    *,
    model: str = "",
    path: str = "/tokenize",
    timeout_s: float = 10.0,
) -> int:
    """Ask the pod at `url` how many tokens `text` is: vLLM's shape first, then llama.cpp's."""
    size = len(text.encode("utf-8"))
    limit = _max_answer_bytes(size)
    vllm: dict[str, str] = {"model": model, "prompt": text} if model else {"prompt": text}
    errors = []
    for body in (vllm, {"content": text}):
        try:
            return read_count(await _post(client, url, path, body, timeout_s, limit), size)
        except TokenizeError as exc:
            errors.append(str(exc))
    raise TokenizeError(f"{url}{path}: " + "; ".join(errors))


async def token_ids(
    client: UpstreamClient, url: str, text: str, *, model: str = "", timeout_s: float = 10.0
) -> list[int]:
    """The pod's token ids of `text` (vLLM's shape only: llama.cpp's blocks are not
    reported), each checked to be an id, no more of them than the text has bytes + slack."""
    size = len(text.encode("utf-8"))
    return await tokens_of(client, url, {"prompt": text}, size, model=model, timeout_s=timeout_s)


async def tokens_of(
    client: UpstreamClient,
    url: str,
    what: dict[str, Any],
    size: int,
    *,
    model: str = "",
    timeout_s: float = 10.0,
) -> list[int]:
    """token_ids of `what`: {"prompt": text} or {"messages": [...]} (the pod renders its
    chat template, as it will for the request), `size` its text's bytes."""
    body = {"model": model, **what} if model else what
    data = await _post(client, url, "/tokenize", body, timeout_s, _max_answer_bytes(size))
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list) or len(tokens) > size + SPECIAL_TOKENS_SLACK:
        raise TokenizeError("no token ids in the answer")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens):
        raise TokenizeError("the token ids are not ids")
    return tokens


class PrefixPass(WokenPass):
    """Asks the first of `pods()` one thing about each registered prefix, in one background
    task; `wake()` after a registration or membership change. A prefix is tried
    ATTEMPTS_PER_PREFIX times; unregistered ones are forgotten, so the state (`learnt`: each
    prefix's answer, by id) is bounded by the store."""

    what = "answer"  # what a failure's log line says is missing

    def __init__(
        self,
        store: PrefixStore,
        client: UpstreamClient,
        pods: Callable[[], Sequence[str]],
        *,
        model: str = "",
    ) -> None:
        super().__init__()
        self.store = store
        self.client = client
        self.pods = pods
        self.model = model
        self.failures: dict[str, int] = {}
        self.learnt: dict[str, int] = {}

    def forget(self, live: set[str]) -> None:
        """Drop what is kept for prefixes no longer registered."""
        self.learnt = {k: v for k, v in self.learnt.items() if k in live}

    def done(self, entry: PrefixEntry) -> bool:
        raise NotImplementedError

    async def ask(self, pod: str, entry: PrefixEntry) -> None:
        """Ask `pod` about `entry` and keep the answer; TokenizeError when there is none."""
        raise NotImplementedError

    async def run_pass(self) -> None:
        entries = list(self.store)
        live = {entry.id for entry in entries}
        self.forget(live)
        self.failures = {k: v for k, v in self.failures.items() if k in live}
        for entry in entries:
            if self.done(entry) or self.failures.get(entry.id, 0) >= ATTEMPTS_PER_PREFIX:
                continue
            pods = self.pods()
            if not pods:
                return  # woken again when pods are there
            try:
                await self.ask(pods[0], entry)
            except TokenizeError as exc:
                self.failures[entry.id] = self.failures.get(entry.id, 0) + 1
                logger.info("prefix %s: no %s (%s)", entry.name, self.what, exc)


class PrefixSizer(PrefixPass):
    """Counts each registered prefix's tokens once, on one pod; a prefix whose count fails
    stays sized from bytes."""

    what = "token count; sized from bytes"  # learnt: the tokens (a re-registration reuses them)

    def done(self, entry: PrefixEntry) -> bool:
        if entry.tokens:
            return True
        known = self.learnt.get(entry.id)
        if known is not None:
            self._keep(entry, known)
        return known is not None

    async def ask(self, pod: str, entry: PrefixEntry) -> None:
        known = await count_tokens(self.client, pod, entry.text, model=self.model)
        self.learnt[entry.id] = known
        self._keep(entry, known)

    def _keep(self, entry: PrefixEntry, known: int) -> None:
        if self.store.set_tokens(entry.id, known):
            logger.info("prefix %s is %d tokens (%d bytes)", entry.name, known, entry.size)
