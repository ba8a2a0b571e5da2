"""What a request weighs in bounded load (config `load_unit`).

With `load_unit: requests` every request in flight weighs 1, as the routing contract's pick
always counted. A cold 16k-token prefill and a cached 100-token query then weigh the same,
though the first holds the pod's prefill for a second and every request behind it waits
(the peers weigh load in prefill tokens: llm-d's token-load scorer, Dynamo's active prefill
tokens, SGLang gateway's least_load over queued tokens).

With `load_unit: tokens` (the default) a request weighs its uncached prefill tokens until its
first token, plus DECODE_TOKENS for as long as it runs. Its prefill is estimated from what
the sidecar knows: a registered prefix warm on the pod costs only the query; a cold one all
of it (upstream/relay.py counts the prefix on a pod not warm with it); an organic later turn
on its session's pod only its newest turn; a flow's start its prompt past its family's head;
any other prompt all of it. Bytes become tokens at BYTES_PER_TOKEN, the placement's. A
registered prefix's spill to a pod that would compute the prefix weighs that too: waiting
on a warm home wins while it weighs less (`stay_warm`).

The cap's floor is counted in thin requests in both units (`floor_units`): below that many a
pod always fits, so a prefix stays on its warm home at low traffic.
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
# What a running request weighs besides its prefill, in tokens: a decode step costs the pod
# one token per request in its batch, for the hundreds of steps of an answer, and holds a
# batch slot and its KV. 128 tokens (one vLLM block) makes a pod with eight streams in decode
# weigh as much as a 1,024-token prefill in flight.
DECODE_TOKENS = 128
# The floor under every pod's cap, in thin requests (routing contract v1, pick's min_cap). A
# vLLM pod batches dozens of requests, so below ~8 in flight spilling a prefix to a cold pod
# costs a full prefill for nothing; at low traffic the proportional cap alone is 1-2 streams.
REQUEST_CAP_FLOOR = 8
# An organic later turn on its session's pod: its history is cached there, its newest turn
# (a question and the last answer) is not; a chat turn is a few hundred tokens.
LATER_TURN_TOKENS = 512
# What one organic request of the floor weighs in tokens: a later turn on its session's pod.
# Weighed as a registered thin query (DECODE_TOKENS), the floor was 1,024 tokens, one cold
# 750-token system prompt in flight: `bench organic` (seed 0, grpc-chat) then spilled 80 of
# 548 requests off their warm pods, hit 0.860 of the ceiling and TTFT p99 1,428 ms, against
# 0.992 and 499 ms counting requests; with this weight 0.990 and 539 ms, same run.
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
    """A registered prefix's pick spilled past its home set (every home over its cap) to
    `backend`: if that pod does not hold the prefix, it would compute its `cold` tokens
    first, so the least-loaded home takes the request instead (branch STAYED) while waiting
    there weighs no more than that. The cap's pick weighs the request as on a warm home."""
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

    tokens: int = 0  # on a pod that holds its prefix (routing/cost.py)
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
