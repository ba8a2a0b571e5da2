"""The router: a prefix, an inline prefix text or a raw prompt -> route key -> pod.

Route keys follow routing contract v1: a prefix routes on key(its UTF-8 bytes); a raw
prompt that starts with a registered prefix routes as that prefix, otherwise on key(first
`route_window_bytes` bytes), so prompts sharing a long head still meet on one pod.
The failover order is the chosen pod, then the rest of its home set, then the rest of the
key's preference order. A registered prefix's home set is the ring's first R owners, or,
with a KV budget, the budgeted placement's (`HomePlacer`, routing contract section 6), which
is rebuilt when the pool swaps its ring or the store's registered set changes.

An unregistered prompt's window is hashed and picked in one core call (`pick_bytes`) when the
policy has that path (prefix_affinity); the table may be the ring or the Maglev table (config
`hash_table`, contract section 8), and the pick reads the pool's running loads total.

Every setting is required (`Router.from_config` passes the config's), so each has one
default: the config's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sidecar import _core
from sidecar.config import Config
from sidecar.membership.pool import BackendPool, RoutingTable
from sidecar.prefixes import PrefixEntry, PrefixStore
from sidecar.routing.pick import Branch, Pick
from sidecar.routing.placement import HomePlacer
from sidecar.routing.policy import Policy, make_policy


class NoBackendError(Exception):
    """No pod can take the request (none known, or all ejected)."""


@dataclass(frozen=True)
class Decision:
    backend: str
    preference: list[str]
    prefix: PrefixEntry | None
    route_key: int
    branch: Branch
    decision_ns: int
    generation: int


class Router:
    def __init__(
        self,
        pool: BackendPool,
        store: PrefixStore,
        policy: Policy,
        *,
        route_window_bytes: int,
        default_replicas: int,
        max_attempts: int,
        home_kv_budget_tokens: int,  # routing contract section 6; 0 = the ring's homes
        home_balance_factor: float,
        bytes_per_token: float,
    ) -> None:
        self.pool = pool
        self.store = store
        self.policy = policy
        self.route_window_bytes = route_window_bytes
        self.default_replicas = default_replicas
        self.max_attempts = max_attempts
        self.placer = HomePlacer(
            store,
            self.replicas_of,
            budget_tokens=home_kv_budget_tokens,
            bytes_per_token=bytes_per_token,
            balance=home_balance_factor,
        )
        self._placing = self.placer.enabled
        # The one-call path from a prompt's bytes to a pod, when the policy has one.
        self._select_bytes = getattr(policy, "select_bytes", None)
        self._watching = False
        if self._placing:
            self._watch_and_place()

    def _watch_and_place(self) -> None:
        if not self._watching:
            self._watching = True
            self.pool.watch(lambda _table: self._place_homes())
            self.store.watch(self._place_homes)
        self._place_homes()

    def set_kv_budget(self, tokens: int) -> None:
        """A new KV budget (from the pods' reported KV, docs/load-signals.md); 0 = the
        ring's homes. Placement changes only here and on membership or registry changes."""
        if tokens == self.placer.budget_tokens:
            return
        self.placer.budget_tokens = tokens
        self._placing = self.placer.enabled
        if self._placing:
            self._watch_and_place()

    @classmethod
    def from_config(
        cls, pool: BackendPool, store: PrefixStore, config: Config, policy: str | None = None
    ) -> Router:
        """The sidecar's router: its policy (`policy`, else the config's) and every setting
        from the config."""
        return cls(
            pool,
            store,
            make_policy(policy or config.policy, config),
            route_window_bytes=config.route_window_bytes,
            default_replicas=config.replicas,
            max_attempts=config.max_attempts,
            home_kv_budget_tokens=config.home_kv_budget_tokens,
            home_balance_factor=config.home_balance_factor,
            bytes_per_token=config.bytes_per_token,
        )

    def _place_homes(self) -> None:
        """Both rings' placements, built when they change: a request only looks them up."""
        self.placer.rebuild(self.pool.table.ring, self.pool.target_ring())

    def replicas_of(self, entry: PrefixEntry | None) -> int:
        """The replica count the prefix asked for, else the configured default."""
        return entry.replicas if entry is not None and entry.replicas else self.default_replicas

    def for_prefix(self, entry: PrefixEntry) -> Decision:
        return self._decide(time.perf_counter_ns(), entry.route_key, entry)

    def for_prefix_text(self, text: str) -> Decision:
        """An unregistered prefix sent inline: same key as if it were registered."""
        started = time.perf_counter_ns()
        entry = self.store.match(text)
        if entry is not None and entry.size == len(text.encode("utf-8")):
            return self._decide(started, entry.route_key, entry)
        return self._decide_bytes(started, text.encode("utf-8"))

    def for_prompt(self, prompt: str) -> Decision:
        started = time.perf_counter_ns()
        entry = self.store.match(prompt)
        if entry is not None:
            return self._decide(started, entry.route_key, entry)
        window = prompt.encode("utf-8")[: self.route_window_bytes]
        return self._decide_bytes(started, window)

    def _decide_bytes(self, started: int, data: bytes) -> Decision:
        """An unregistered key: hashed and picked in one core call when the policy can."""
        select_bytes = self._select_bytes
        if select_bytes is None:
            return self._decide(started, _core.route_key(data), None)
        table = self.pool.table
        ring = _serving(table)
        replicas = self.default_replicas
        backend, branch, key = select_bytes(table, data, replicas)
        attempts = self.max_attempts
        preference = ring.preference(key, replicas if replicas > attempts else attempts)
        return self._decision(started, table, key, None, backend, branch, preference)

    def _decide(self, started: int, key: int, entry: PrefixEntry | None) -> Decision:
        table = self.pool.table
        ring = _serving(table)
        homes = None
        if entry is None:
            replicas = self.default_replicas
        else:
            replicas = entry.replicas or self.default_replicas  # replicas_of, inlined
            if self._placing:
                homes = self.placer.homes(ring, entry)
        backend, branch = self.policy.select(
            table, Pick(key, replicas, homes.indexes if homes is not None else None)
        )
        attempts = self.max_attempts
        if homes is not None:
            home_count = len(homes.indexes)
            preference = list(homes.order[: home_count if home_count > attempts else attempts])
        else:
            preference = ring.preference(key, replicas if replicas > attempts else attempts)
        return self._decision(started, table, key, entry, backend, branch, preference)

    @staticmethod
    def _decision(
        started: int,
        table: RoutingTable,
        key: int,
        entry: PrefixEntry | None,
        backend: str,
        branch: Branch,
        preference: list[str],
    ) -> Decision:
        # The chosen pod first, then the rest in order (cheaper than rebuilding the list).
        if preference[0] != backend:
            if backend in preference:
                preference.remove(backend)
            preference.insert(0, backend)
        elapsed = time.perf_counter_ns() - started
        return Decision(
            backend=backend,
            preference=preference,
            prefix=entry,
            route_key=key,
            branch=branch,
            decision_ns=elapsed,
            generation=table.generation,
        )

    def home_set(self, entry: PrefixEntry) -> list[str]:
        """The prefix's home set on the target ring (every pod not ejected), first choice
        first: where it should be resident once warming pods serve."""
        ring = self.pool.target_ring()
        if ring is None:
            return []
        homes = self.placer.homes(ring, entry)
        if homes is not None:
            return list(homes.order[: len(homes.indexes)])
        return ring.preference(entry.route_key, self.replicas_of(entry))

    def homed_tokens(self) -> dict[str, int]:
        """Estimated prefix tokens each pod is home to (target ring): what the budget bounds."""
        ring = self.pool.target_ring()
        totals = dict.fromkeys(ring.members if ring is not None else (), 0)
        for entry in self.store:
            for url in self.home_set(entry):
                totals[url] += self.placer.tokens_of(entry)
        return totals


def _serving(table: RoutingTable) -> _core.HashTable:
    """The table's ring, or the error that says why there is none."""
    ring = table.ring
    if ring is None:
        raise NoBackendError(
            "no healthy vLLM pod: every backend is ejected or none is configured "
            "(check --backend / backends_file / backends_dns and the pods' health)"
        )
    return ring
