"""Which pool a caller's body goes to: its model, peeked at first, picks the pool whose
prefixes the body is then read with (body.py). An unknown model is a 404 (model_not_found).

The peek cuts out the route string as body.py does and parses only the small rest, so a long
prompt is scanned for its closing quote, never decoded. A body that cannot be peeked at (a
token-id prompt, an unusual escape) is read once with no prefix store to find its model.
"""

from __future__ import annotations

import json

from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.server.model_pool import ModelPool
from prefix_sidecar.server.openai.body import (
    Cut,
    FrontError,
    FrontRequest,
    bad_request,
    cut_out,
    route_string_span,
)
from prefix_sidecar.server.openai.body_steps import read_request
from prefix_sidecar.server.pools import Pools, UnknownModel

# The body without its route string is parsed whole only when it is this small; a larger
# one (a long chat's later messages) is left to the front's stepped reading.
MAX_REST_BYTES = 64 * 1024


def peek_model(raw: bytes, chat: bool) -> str | None:
    """The body's `model` ("" when it names none), or None when it cannot be read without
    reading the body whole. A model that is not a string is the caller's 400."""
    span = route_string_span(raw, chat)
    if span is None:
        return None
    rest = cut_out(raw, Cut(*span, None))
    if len(rest) > MAX_REST_BYTES:
        return None
    try:
        data = json.loads(rest)
    except (ValueError, RecursionError):
        return None  # the front's whole read says what is wrong
    if not isinstance(data, dict):
        return None
    model = data.get("model", "")
    if model is None:
        return ""
    if not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    return model


async def read_in_pool(pools: Pools, raw: bytes, chat: bool) -> tuple[ModelPool, FrontRequest]:
    """The request's pool, by its body's model, and what routing reads of the body. With
    several pools the model is peeked at, or when it cannot be, found by a read without
    prefixes; the body is then read with the pool's."""
    pool = pools.default
    if len(pools) > 1:
        model = peek_model(raw, chat)
        if model is None:
            model = (await _read_with(pool, raw, chat, None)).model or ""
        try:
            pool = pools.for_model(model)
        except UnknownModel as exc:
            raise FrontError(404, str(exc), param="model", code="model_not_found") from None
    return pool, await _read_with(pool, raw, chat, pool.store)


async def _read_with(
    pool: ModelPool, raw: bytes, chat: bool, store: PrefixStore | None
) -> FrontRequest:
    router = pool.router
    return await read_request(
        raw, chat=chat, store=store, window=router.head_bytes, turns=router.follows_conversations
    )
