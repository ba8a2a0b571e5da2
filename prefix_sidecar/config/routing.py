"""How a request picks its pod: the route-key scheme, the replicas per prefix, bounded load,
the KV budget of homed prefixes, the hash table and the failover depth.

Only what an operator sets is here; benchmark-tuned constants live in their modules
(routing/organic.py, membership/load_signals/, routing/placement.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefix_sidecar._core_py import HASH_TABLES
from prefix_sidecar.config.checks import existing_file
from prefix_sidecar.fields import at_least, one_of, setting

UNREGISTERED_ROUTING = ("organic", "window", "precise")
LOAD_UNITS = ("tokens", "requests")  # routing/cost.py


@dataclass(frozen=True)
class RoutingSettings:
    """The pick and what it reads."""

    # docs/organic-routing.md, routing contract 9: organic keys a chat by its system and first
    # user message and a raw prompt by learnt anchors; window keys the first 4 KB; precise
    # moves organic's pick to the pod whose KV events show the longest prefix of the prompt.
    unregistered_routing: str = setting(
        "organic",
        "organic (learnt anchors, chat structure), window (key of the first bytes) or precise "
        "(organic, then the pod holding the most of the prompt by the pods' KV events: needs "
        "kv_events=true or kv_index_url); the key-less baseline policies (round_robin, random, "
        "least_loaded) compute no organic keys",
        check=one_of(UNREGISTERED_ROUTING),
    )
    # Precise routing's token ids of a raw prompt without a pod's /tokenize, which a busy
    # pod answers behind its prefills (upstream/local_tokenizer.py).
    tokenizer_file: str = setting(
        "",
        "with unregistered_routing precise: the pods' model's tokenizer.json; raw prompts are "
        "tokenized here once a pod has confirmed its ids (the tokenizer extra); chats still "
        "ask a pod's /tokenize",
        check=existing_file,
    )
    replicas: int = setting(1, "pods per prefix (R of the routing contract)", check=at_least(1))
    load_factor: float = setting(
        1.25, "bounded-load factor c: a pod's cap is c x its fair share", check=at_least(1.0)
    )
    # See routing/cost.py. The cap's floor is REQUEST_CAP_FLOOR thin requests in either unit.
    load_unit: str = setting(
        "tokens",
        "what bounded load counts: tokens (a request's uncached prefill tokens until its "
        "first token, plus a decode term) or requests",
        check=one_of(LOAD_UNITS),
    )
    # Routing contract section 6: set it to the pods' KV size minus what in-flight requests
    # need. 0 takes half the pods' smallest reported KV (docs/load-signals.md), else the plain
    # ring placement.
    home_kv_budget_tokens: int = setting(
        0,
        "most prefix KV tokens a pod is home to, per unit of weight; 0 = plain ring",
        check=at_least(0, " (0 = plain ring placement)"),
    )
    # The pods' own load and KV (docs/load-signals.md): every request asks for vLLM's ORCA
    # load header, a few pods per interval are asked for /metrics, and the pick counts every
    # sidecar's requests while the reading is fresh. Off: each sidecar sees its own only.
    load_signals: bool = setting(True, "read the pods' load and KV (ORCA header, /metrics polls)")
    # Routing contract section 8: the Maglev table moves a few more keys when a pod leaves
    # but its lookup is one modulo and its balance is near exact. Every sidecar of a fleet
    # must use the same table.
    hash_table: str = setting(
        "ring",
        "the routing table: ring (contract 3) or maglev (contract 8)",
        check=one_of(HASH_TABLES),
    )
    max_attempts: int = setting(
        3, "pods a request may try before its first token", check=at_least(1)
    )
