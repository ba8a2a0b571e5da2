"""What a request weighs in bounded load (config `load_unit`).

`requests`: each in-flight request weighs 1 (routing contract v1). `tokens` (the default):
its uncached prefill tokens until its first token, plus DECODE_TOKENS while it runs, since a
cold long prefill holds the pod far longer than a cached query (as llm-d, Dynamo and SGLang
gateway weigh load). Prefill is estimated at BYTES_PER_TOKEN: a registered prefix warm on
the pod, the query only; cold, the prefix too (upstream/relay.py); an organic later turn,
its newest turn; a start, its prompt past its family's head; anything else, all of it.
The cap's floor is counted in thin requests in both units (`floor_units`), so a prefix
stays on its warm home at low traffic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from prefix_sidecar.config.routing import LOAD_UNITS
from prefix_sidecar.routing.decision import Decision
from prefix_sidecar.routing.organic import OrganicKeys
from prefix_sidecar.routing.pick import Branch
from prefix_sidecar.routing.placement import BYTES_PER_TOKEN
from prefix_sidecar.routing.table import RoutingTable

TOKENS, REQUESTS = LOAD_UNITS
# A running request's weight besides its prefill, in tokens: each decode step costs a token
# per batched request, and it holds a batch slot and KV. 128 (one vLLM block): eight decoding
# streams weigh a 1,024-token prefill.
DECODE_TOKENS = 128
# The floor under every pod's cap in thin requests (contract v1 min_cap): a vLLM pod batches
# dozens, so spilling to a cold pod below ~8 in flight buys a full prefill for nothing.
REQUEST_CAP_FLOOR = 8
# An organic later turn on its session's pod: its history is cached there, its newest turn
# (a question and the last answer) is not; a chat turn is a few hundred tokens.
LATER_TURN_TOKENS = 512
# One organic request of the floor, in tokens: a later turn on its session's pod.
# bench organic: TTFT p99 539 ms, against 1,428 ms weighing it as a thin query.
ORGANIC_REQUEST_TOKENS = LATER_TURN_TOKENS + DECODE_TOKENS
# Bounds one request's estimate (a 4 MiB prefix is ~1M tokens): loads stay far below int64.
MAX_REQUEST_TOKENS = 1 << 22


def organic_prefill(keys: OrganicKeys, tokens: int) -> int:
    """What of an organic request's `tokens` its pod has not computed, estimated: a later
    turn's newest turn, a start's prompt past its family's head, an unanchored prompt all."""
    if keys.anchor < 0:
        return tokens
    if not keys.start:
        return min(tokens, LATER_TURN_TOKENS)
    return max(tokens - tokens_of(keys.head), 0)


def stay_warm(
    table: RoutingTable,
    homes: tuple[str, ...],
    backend: str,
    branch: Branch,
    cold: int,
    holds: Callable[[str], bool],
) -> tuple[str, Branch]:
    """For a registered prefix's pick spilled past its home set to `backend`: if `backend`
    lacks the prefix (it would compute `cold` tokens first), the least-loaded home instead
    (branch STAYED) while its load is at most `backend`'s plus `cold`."""
    index, loads = table.index, table.loads
    here = index.get(backend)
    members = [index[home] for home in homes if home in index]
    if here is None or not members or holds(backend):
        return backend, branch
    home = min(members, key=loads.__getitem__)  # ties: the earlier home
    if loads[home] <= loads[here] + cold:
        return table.members[home], Branch.STAYED
    return backend, branch


def tokens_of(nbytes: int) -> int:
    """Tokens in `nbytes` of prompt text, estimated, bounded."""
    return min(math.ceil(max(nbytes, 0) / BYTES_PER_TOKEN), MAX_REQUEST_TOKENS)


def pick_cost(unit: str, prefill: int) -> int:
    """What a request with `prefill` uncached tokens adds to a pod's load."""
    return 1 if unit == REQUESTS else min(prefill, MAX_REQUEST_TOKENS) + DECODE_TOKENS


def floor_units(unit: str, requests: int, request_tokens: int = DECODE_TOKENS) -> int:
    """A floor of `requests` thin requests in the load unit, each `request_tokens` in tokens."""
    return requests if unit == REQUESTS else requests * request_tokens


def organic_floor(unit: str, requests: int) -> int:
    """Organic picks' floor (min_cap): `requests` later turns in the load unit."""
    return floor_units(unit, requests, ORGANIC_REQUEST_TOKENS)


@dataclass(frozen=True)
class Prefill:
    """What a request's prefill weighs on a pod it may try (membership/pool.py `prefill_on`)."""

    tokens: int = 0  # on a pod that holds its prefix
    cold: int = 0  # more on one that does not: the prefix's own tokens
    prefix_id: str = ""
    homes: tuple[str, ...] = ()  # its prefix's home set: warmed before they serve

    @classmethod
    def of(cls, decision: Decision) -> Prefill:
        prefix = decision.prefix
        if not decision.cold or prefix is None:
            return cls(decision.prefill)
        return cls(decision.prefill, decision.cold, prefix.id, decision.homes)


NO_PREFILL = Prefill()
