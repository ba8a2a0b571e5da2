"""The router: a prefix, inline prefix text, raw prompt or chat -> route key -> `Decision`.

Routing contract v1: a prefix routes on key(its UTF-8); a prompt starting with a registered
prefix routes as that prefix; other prompts and chats by organic keys (contract 9,
`OrganicRouter`) or, with `unregistered_routing: window`, on key(first ROUTE_WINDOW_BYTES)
(a chat: its first message). A registered prefix's home set is the ring's first R owners or,
with a KV budget, the placement's (`HomePlacer`, contract section 6). Failover: the chosen
pod, the rest of its home set, then the key's preference order. Every setting is required
(`Router.from_config`, routing/router_settings.py), so each has one default.
"""

from __future__ import annotations

import time
from dataclasses import replace

from prefix_sidecar import _core
from prefix_sidecar.config import Config
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.prefixes import PrefixEntry, PrefixStore
from prefix_sidecar.routing.adapters import AdapterView, holder_homes, to_adapter_holder
from prefix_sidecar.routing.anchors import AnchorTable
from prefix_sidecar.routing.chat_templates import NOT_FOLLOWED, turn_marks
from prefix_sidecar.routing.cost import TOKENS, organic_floor, organic_prefill, stay_warm, tokens_of
from prefix_sidecar.routing.decision import Decision, PreciseStep, serving_ring
from prefix_sidecar.routing.organic import HEAD_BYTES, OrganicKeys, OrganicRouter
from prefix_sidecar.routing.pick import Branch, Pick
from prefix_sidecar.routing.placement import HomePlacer
from prefix_sidecar.routing.policy import Policy, make_policy
from prefix_sidecar.routing.policy_names import PREFIX_AFFINITY
from prefix_sidecar.routing.resident import ResidencyView, to_resident
from prefix_sidecar.routing.router_settings import settings
from prefix_sidecar.routing.scope import NO_SCOPE, Scope, scoped_key
from prefix_sidecar.routing.table import RoutingTable

# The pick production uses; the others are baselines that benchmarks run the same sidecar
# with (`--tune policy=...`, prefix_sidecar_tools.tuned), so the name is no setting.
DEFAULT_POLICY = PREFIX_AFFINITY


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
        unregistered_routing: str,  # "organic" (routing contract 9), "window" or "precise"
        organic_home_spread: float,
        organic_session_spread: float,
        organic_table_blocks: int,
        organic_load_cap_floor: int,
        organic_balance_starts: bool,
        organic_follow_sessions: bool,
    ) -> None:
        if unregistered_routing not in ("organic", "window", "precise"):
            raise ValueError(
                f"unregistered_routing is {unregistered_routing!r}; organic, window or precise"
            )
        self.pool = pool
        self.store = store
        self.policy = policy
        self.route_window_bytes = route_window_bytes
        # A policy that ignores the key (a baseline) gets no organic keys: they would cost
        # time and count decisions it never made.
        # precise starts from the organic decision (kv_events/precise.py moves it)
        organic_on = unregistered_routing != "window" and not getattr(policy, "ignores_key", False)
        # How much of an unregistered prompt's head routing reads: a caller may pass just
        # that much (the HTTP front decodes no more of a long prompt).
        self.head_bytes = max(route_window_bytes, HEAD_BYTES if organic_on else 0)
        self.default_replicas = default_replicas
        self.max_attempts = max_attempts
        self.placer = HomePlacer(
            store,
            self.replicas_of,
            budget_tokens=home_kv_budget_tokens,
            bytes_per_token=bytes_per_token,
            balance=home_balance_factor,
        )
        # Loads counted in tokens: a spill that would compute a prefix weighs it (cost.py).
        self._tokens = getattr(policy, "load_unit", "") == TOKENS
        # The one-call path from a prompt's bytes to a pod, when the policy has one.
        self._select_bytes = getattr(policy, "select_bytes", None)
        self._watching = False
        self.organic = (
            OrganicRouter(
                AnchorTable(max_blocks=organic_table_blocks),
                organic_home_spread,
                session_spread=organic_session_spread,
                balance_starts=organic_balance_starts,
                follow_sessions=organic_follow_sessions,
            )
            if organic_on
            else None
        )
        self.organic_floor = organic_floor(getattr(policy, "load_unit", ""), organic_load_cap_floor)
        # Set by the sidecar with kv_events on: a registered prefix then avoids a home known
        # to have lost it (routing/resident.py).
        self.residency: ResidencyView | None = None
        # Set with unregistered_routing precise: the fronts await it for unregistered requests.
        self.precise: PreciseStep | None = None
        # Set by the pool: which pod holds which LoRA adapter (routing/adapters.py).
        self.adapters: AdapterView | None = None
        if self.placer.enabled:
            self._watch_and_place()

    @property
    def follows_conversations(self) -> bool:
        """Whether organic routing follows conversations (9h): a prompt's chat-template
        headers are worth reading."""
        return self.organic is not None and self.organic.follow is not None

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
        if self.placer.enabled:
            self._watch_and_place()

    @classmethod
    def from_config(
        cls, pool: BackendPool, store: PrefixStore, config: Config, policy: str | None = None
    ) -> Router:
        """The sidecar's router: its policy (`policy`, else DEFAULT_POLICY), every field
        from the config and every tuning constant from its module."""
        return cls(pool, store, make_policy(policy or DEFAULT_POLICY, config), **settings(config))

    def _place_homes(self) -> None:
        """Both rings' placements, built when they change: a request only looks them up."""
        self.placer.rebuild(self.pool.table.ring, self.pool.target_ring())

    def replicas_of(self, entry: PrefixEntry | None) -> int:
        """The replica count the prefix asked for, else the configured default."""
        return entry.replicas if entry is not None and entry.replicas else self.default_replicas

    def for_prefix(self, entry: PrefixEntry, scope: Scope = NO_SCOPE, tokens: int = 0) -> Decision:
        """A registered prefix; `scope`: the request's adapter and salt (contract 10);
        `tokens`: the request's own tokens past the prefix (its query), estimated."""
        return self._for_entry(time.perf_counter_ns(), entry, scope, tokens)

    def _for_entry(self, started: int, entry: PrefixEntry, scope: Scope, tokens: int) -> Decision:
        """The entry's own decision in its scope; in another, that scope's entry of the same
        text, else the text's key scoped (no placement, nothing warm: the text alone)."""
        if entry.scope is scope or entry.scope == scope:
            return self._scoped(self._decide(started, entry.route_key, entry, tokens), scope)
        own = self.store.in_scope(entry, scope)
        if own is not None:
            return self._scoped(self._decide(started, own.route_key, own, tokens), scope)
        cold = tokens + tokens_of(entry.size)
        decision = self._decide(started, scoped_key(entry.text_key, scope), None, cold)
        return self._scoped(replace(decision, prefix=entry), scope)

    def for_prefix_text(self, text: str, scope: Scope = NO_SCOPE, tokens: int = 0) -> Decision:
        """An unregistered prefix sent inline: same key as if it were registered."""
        started = time.perf_counter_ns()
        data = text.encode("utf-8")
        entry = self.store.match(text)
        if entry is not None and entry.size == len(data):
            return self._for_entry(started, entry, scope, tokens)
        return self._decide_bytes(started, data, scope, tokens + tokens_of(len(data)))

    def for_prompt(
        self,
        prompt: str,
        marks: tuple[int, int] | None = None,
        scope: Scope = NO_SCOPE,
        tokens: int | None = None,
    ) -> Decision:
        """`marks`: the prompt's (mark, after) by its chat template, when `prompt` is only its
        head (default: read from `prompt`; organic routing's 9h); `tokens`: the whole
        prompt's, estimated (default: from `prompt`)."""
        started = time.perf_counter_ns()
        if tokens is None:
            tokens = tokens_of(len(prompt.encode("utf-8", "surrogatepass")))
        entry = self.store.match(prompt)
        if entry is not None:
            return self._for_entry(started, entry, scope, tokens - tokens_of(entry.size))
        organic = self.organic
        if organic is not None:
            head = prompt[:HEAD_BYTES].encode("utf-8")[:HEAD_BYTES]
            if organic.follow is None:
                marks = NOT_FOLLOWED  # nothing is followed: nothing to read
            elif marks is None:
                marks = turn_marks(prompt)
            keys = organic.for_prompt(head, marks)
            if keys is not None:
                return self._decide_organic(started, keys, scope, tokens)
        window = prompt.encode("utf-8")[: self.route_window_bytes]
        return self._decide_bytes(started, window, scope, tokens)

    def _decide_bytes(self, started: int, data: bytes, scope: Scope, prefill: int) -> Decision:
        """An unregistered key: hashed and picked in one core call when the policy can."""
        select_bytes = self._select_bytes
        if select_bytes is None or not scope.empty:
            key = scoped_key(_core.route_key(data), scope)
            return self._scoped(self._decide(started, key, None, prefill), scope)
        table = self.pool.table
        ring = serving_ring(table)
        replicas = self.default_replicas
        backend, branch, key = select_bytes(table, data, replicas, prefill)
        attempts = self.max_attempts
        preference = ring.preference(key, replicas if replicas > attempts else attempts)
        forced = replicas == 1 and branch is Branch.HOME
        return self._decision(
            started, table, key, None, backend, branch, preference, forced, prefill
        )

    def for_chat(
        self,
        messages: list[tuple[str, str]],
        answers: int | None = None,
        scope: Scope = NO_SCOPE,
        tokens: int | None = None,
    ) -> Decision:
        """An unregistered chat, messages as (role, text): its first message routes as a
        registered prefix when it starts with one; otherwise by its structure (organic), or
        as a prompt of its first message's text (window). `answers`: the whole chat's
        assistant messages when `messages` holds only its first ones; `tokens`: the whole
        chat's, estimated (default: from `messages`)."""
        if tokens is None:
            tokens = tokens_of(sum(len(text) for _, text in messages))
        first = messages[0][1] if messages else ""
        if self.organic is None or self.store.match(first) is not None:
            return self.for_prompt(first, scope=scope, tokens=tokens)
        started = time.perf_counter_ns()
        keys = self.organic.for_chat(messages, answers)
        return self._decide_organic(started, keys, scope, tokens)

    def _scoped(self, decision: Decision, scope: Scope) -> Decision:
        """An adapter's request moved to a pod that holds it (routing/adapters.py)."""
        if not scope.adapter or self.adapters is None:
            return decision
        return to_adapter_holder(self.policy, self.pool.table, decision, scope, self.adapters)

    def _decide_organic(
        self, started: int, keys: OrganicKeys, scope: Scope, tokens: int
    ) -> Decision:
        """The session's pod in its family's home set, under bounded load (contract 9);
        its keys scoped (contract 10); its prefill what its pod has not seen (cost.py)."""
        if not scope.empty:
            keys = keys._replace(
                family=scoped_key(keys.family, scope), session=scoped_key(keys.session, scope)
            )
        table = self.pool.table
        ring = serving_ring(table)
        assert self.organic is not None
        home = self.organic.homes(ring, keys)
        # The spill walks the family's preference order: its home set first, where the
        # family's shared head is warm; a spilled session keeps spilling to one pod.
        prefill = organic_prefill(keys, tokens)
        pick = Pick(keys.family, 1, (home,), self.organic_floor, prefill)
        backend, branch = self.policy.select(table, pick)
        self.organic.sent(ring, backend, keys)
        # Failover: the chosen pod, the session's home pod, then the family's order.
        preference = [backend]
        for member in (ring.members[home], *ring.preference(keys.family, self.max_attempts)):
            if member not in preference and len(preference) < self.max_attempts:
                preference.append(member)
        # a later turn on its session's pod; a start's pod is a choice (9f)
        forced = branch is Branch.HOME and not keys.start
        decision = self._decision(
            started, table, keys.session, None, backend, branch, preference, forced, prefill
        )
        return self._scoped(decision, scope)

    def _decide(
        self, started: int, key: int, entry: PrefixEntry | None, prefill: int = 0
    ) -> Decision:
        table = self.pool.table
        ring = serving_ring(table)
        homes = None
        if entry is None:
            replicas = self.default_replicas
        else:
            replicas = entry.replicas or self.default_replicas  # replicas_of, inlined
            homes = self.placer.homes(ring, entry)
        backend, branch = self.policy.select(
            table, Pick(key, replicas, homes.indexes if homes is not None else None, None, prefill)
        )
        if entry is not None and self.residency is not None:
            home_set = (
                homes.order[: len(homes.indexes)]
                if homes is not None
                else ring.preference(key, replicas)
            )
            backend = to_resident(
                self.policy, table, key, home_set, entry.id, backend, self.residency
            )
        attempts = self.max_attempts
        if homes is not None:
            home_count = len(homes.indexes)
            preference = list(homes.order[: home_count if home_count > attempts else attempts])
        else:
            home_count = replicas
            preference = ring.preference(key, replicas if replicas > attempts else attempts)
        # The home set (the preference order's head) before the chosen pod moves first.
        warm = tuple(preference[:home_count]) if entry is not None else ()
        if warm and branch is not Branch.HOME and self._tokens and backend not in warm:
            assert entry is not None
            backend, branch = stay_warm(
                table, warm, backend, branch, entry.tokens or tokens_of(entry.size),
                lambda url: self.pool.holds(url, entry.id),
            )  # fmt: skip
        forced = home_count == 1 and branch is Branch.HOME
        return self._decision(
            started, table, key, entry, backend, branch, preference, forced, prefill, warm
        )

    @staticmethod
    def _decision(
        started: int,
        table: RoutingTable,
        key: int,
        entry: PrefixEntry | None,
        backend: str,
        branch: Branch,
        preference: list[str],
        forced: bool,
        prefill: int,
        homes: tuple[str, ...] = (),
    ) -> Decision:
        # The chosen pod first, then the rest in order (cheaper than rebuilding the list).
        if preference[0] != backend:
            if backend in preference:
                preference.remove(backend)
            preference.insert(0, backend)
        return Decision(
            backend=backend,
            preference=preference,
            prefix=entry,
            route_key=key,
            branch=branch,
            decision_ns=time.perf_counter_ns() - started,
            generation=table.generation,
            forced=forced,
            prefill=prefill,
            cold=(entry.tokens or tokens_of(entry.size)) if entry is not None else 0,
            homes=homes,
        )

    def home_set(self, entry: PrefixEntry) -> list[str]:
        """The prefix's home set on the target ring (every pod not ejected), first choice
        first: where it should be resident once warming pods serve; an adapter's, among the
        pods that hold the adapter."""
        ring = self.pool.target_ring()
        if ring is None:
            return []
        if entry.scope.adapter and self.adapters is not None:
            return holder_homes(ring, entry, self.replicas_of(entry), self.adapters)
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
