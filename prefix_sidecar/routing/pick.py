"""What every policy is given and what it answers: a `Pick` in, a pod and a `Branch` out.

The branch names are wire values (`RouteReply.branch`), metric labels (`branch=`) and log
words, so they are spelled once, here; a `StrEnum` compares and prints as those strings.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class Branch(StrEnum):
    """Which rule decided a pick."""

    # Bounded load (routing contract v1, step 5; the core's own words).
    HOME = "home"  # the least-loaded pod of the home set, under its cap
    SPILL = "spill"  # every home over its cap: the next pod clockwise that is under it
    FALLBACK = "fallback"  # every pod over its cap: the least-loaded of all
    # Precise organic routing: the pod that holds the longest prefix of the prompt, by the
    # pods' KV events, under its cap (routing/precise.py).
    CACHED = "cached"
    # Precise organic routing, a prompt no pod holds: the pod this sidecar has sent the
    # least new content lately, under its cap (routing/precise.py to_emptiest).
    EMPTIEST = "emptiest"
    # Precise organic routing: the pod whose first token would come first, its prefill queue
    # counted, when sooner by a margin and under its cap (routing/precise.py to_quickest).
    QUICKEST = "quickest"
    # Load in tokens: every home over its cap, but the spill's pod would compute the prefix,
    # which weighs more than waiting on the least-loaded home (routing/cost.py stay_warm).
    STAYED = "stayed"
    # A LoRA adapter's request moved to a pod that holds the adapter (routing/adapters.py).
    ADAPTER = "adapter"
    # The baselines, one branch each.
    RING_HIT = "ring_hit"  # consistent_hash: the key's ring owner, whatever its load
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"


class Pick(NamedTuple):
    """One request to place. A NamedTuple: immutable, and built on every request at about
    half the cost of a frozen dataclass."""

    key: int  # the route key (routing contract v1)
    replicas: int  # R: how many of the key's ring owners form its home set
    # The budgeted home set (member indexes into the table, preference order, routing
    # contract section 6), used instead of the ring's first R owners; None without a budget.
    homes: tuple[int, ...] | None
    # The caps' floor (min_cap) in the pool's load unit (routing/cost.py floor_units);
    # None: the policy's. Organic routing passes its own (routing/organic.py).
    min_cap: int | None = None
    # The request's uncached prefill tokens, estimated (routing/cost.py): with load counted
    # in tokens, what it adds to a pod's load with the decode term.
    prefill: int = 0
