"""Scopes (routing contract 10): a request's LoRA adapter and cache salt scope its route key,
a prefix registered in a scope is an entry of its own, and an adapter's request goes to a pod
that holds the adapter. Golden vectors pin the keys; both cores give them."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from prefix_sidecar import _core
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.routing.pick import Branch
from prefix_sidecar.routing.scope import (
    MAX_SALT_BYTES,
    NO_SCOPE,
    Scope,
    checked_salt,
    scope_bytes,
    scoped_key,
    scoped_prefix_id,
)

from .conftest import MakeRouter, pods, serving_pool

TEXT = "Rule: no lowest price ever claim without proof."
# Routing contract 10's vectors: key(TEXT) and its scoped keys.
KEY = 12842365717687258989
GOLDEN = [
    (Scope("lora-a", ""), b"\x00\x00\x00\x06lora-a\x00\x00\x00\x00", 2535183770368746415),
    (Scope("", "tenant-a"), b"\x00\x00\x00\x00\x00\x00\x00\x08tenant-a", 15128272275109537476),
    (
        Scope("lora-a", "tenant-a"),
        b"\x00\x00\x00\x06lora-a\x00\x00\x00\x08tenant-a",
        14787367913051056682,
    ),
    (Scope("a\x00b", ""), b"\x00\x00\x00\x03a\x00b\x00\x00\x00\x00", 13496611626908970551),
    (Scope("a", "b"), b"\x00\x00\x00\x01a\x00\x00\x00\x01b", 12404026708762731813),
]


def test_the_scoped_keys_are_the_contracts_golden_vectors() -> None:
    assert _core.prefix_route_key(TEXT) == KEY
    assert scoped_key(KEY, NO_SCOPE) == KEY  # an empty scope changes nothing
    for scope, data, key in GOLDEN:
        assert scope_bytes(scope) == data
        assert scoped_key(KEY, scope) == key
        assert _core.route_key(data + KEY.to_bytes(8, "big")) == key
    # Length-prefixed: an adapter holding a NUL is not another adapter and salt.
    assert len({key for _, _, key in GOLDEN}) == len(GOLDEN)
    assert scoped_prefix_id(_core.prefix_id("x"), Scope("lora-a")) == (
        "0821e709a2e841471930fb938d229c97e4931e64c84d92af82748856652b25de"
    )


def test_a_salt_is_bounded_and_a_string() -> None:
    assert checked_salt("t" * MAX_SALT_BYTES) == "t" * MAX_SALT_BYTES
    with pytest.raises(ValueError, match="over 1024 bytes"):
        checked_salt("é" * 600)
    with pytest.raises(ValueError, match="must be a string"):
        checked_salt(7)


def test_one_text_is_an_entry_per_scope() -> None:
    store = PrefixStore()
    base, _ = store.register("rules", TEXT)
    lora, created = store.register("rules", TEXT, scope=Scope("lora-a"))
    assert created and lora.id != base.id and lora.text_id == base.id == _core.prefix_id(TEXT)
    assert (base.route_key, lora.route_key) == (KEY, 2535183770368746415)
    assert store.register("rules", TEXT, scope=Scope("lora-a")) == (lora, False)
    assert store.by_name("rules") is base and store.by_name("rules", Scope("lora-a")) is lora
    # A scope it was not registered in: its newest version's text.
    assert store.by_name("rules", Scope("", "t")) is lora
    assert store.in_scope(base, Scope("lora-a")) is lora
    assert store.in_scope(lora, NO_SCOPE) is base
    assert store.in_scope(base, Scope("", "t")) is None
    assert store.unregister_name("rules") == [base.id, lora.id]


def test_a_scoped_request_routes_on_its_scoped_key(make_router: MakeRouter) -> None:
    pool = serving_pool(pods(8))
    store = PrefixStore()
    entry, _ = store.register("rules", TEXT)
    router = make_router(pool, store)
    ring = pool.table.ring
    assert ring is not None
    for scope in (NO_SCOPE, *(scope for scope, _, _ in GOLDEN)):
        decision = router.for_prefix(entry, scope)
        assert decision.route_key == scoped_key(KEY, scope)
        assert decision.backend == ring.owner(scoped_key(KEY, scope))
        assert decision.prefix is entry  # its text is still what the pod gets
    # Registered in the scope: its own entry, the same key.
    lora, _ = store.register("rules-a", TEXT, scope=Scope("lora-a"))
    decision = router.for_prefix(entry, Scope("lora-a"))
    assert decision.prefix is lora and decision.route_key == lora.route_key
    # A salted prompt nobody registered: the same salt, the same key; another, another.
    salted = [router.for_prompt("x" * 9000, scope=Scope("", s)).route_key for s in "aab"]
    assert salted[0] == salted[1] != salted[2]
    chats = [
        router.for_chat([("system", "be brief " * 40), ("user", "hi")], scope=Scope("", s))
        for s in ("", "a")
    ]
    assert chats[0].route_key != chats[1].route_key


@dataclass
class Holders:
    """An AdapterView: which pod holds which adapter."""

    held: dict[str, set[str]] = field(default_factory=dict)

    def holds(self, pod: str, adapter: str) -> bool:
        return adapter in self.held.get(pod, set())


def test_an_adapters_request_goes_to_a_pod_that_holds_it(make_router: MakeRouter) -> None:
    urls = pods(6)
    pool = serving_pool(urls)
    store = PrefixStore()
    entry, _ = store.register("rules", TEXT, replicas=2)
    router = make_router(pool, store, replicas=2, cap_floor=0)
    holders = Holders()
    router.adapters = holders
    scope = Scope("lora-a")
    plain = router.for_prefix(entry, scope)
    home_set = plain.preference[:2]
    # Nobody holds it (yet): the pick stands.
    again = router.for_prefix(entry, scope)
    assert (again.backend, again.branch) == (plain.backend, plain.branch) != Branch.ADAPTER
    # The second home holds it: there.
    holders.held = {home_set[1]: {"lora-a"}}
    moved = router.for_prefix(entry, scope)
    assert (moved.backend, moved.branch) == (home_set[1], Branch.ADAPTER)
    # Only a pod outside the home set holds it: there, and it is first in the failover order.
    far = next(url for url in plain.preference if url not in home_set)
    holders.held = {far: {"lora-a"}}
    moved = router.for_prefix(entry, scope)
    assert moved.backend == far and moved.preference[0] == far
    assert sorted(moved.preference) == sorted(dict.fromkeys(moved.preference))
    # Two holders, the first over its cap: the other one.
    other = next(url for url in urls if url not in (*home_set, far))
    holders.held = {far: {"lora-a"}, other: {"lora-a"}}
    for _ in range(12):
        pool.acquire(far)
    assert router.for_prefix(entry, scope).backend == other
    # Every holder over its cap: the least loaded of them, never a pod without it.
    for _ in range(20):
        pool.acquire(other)
    assert router.for_prefix(entry, scope).backend == far
    # The base model's requests are not moved.
    base = router.for_prefix(entry)
    assert base.branch is not Branch.ADAPTER and base.route_key == KEY


def test_a_prefix_registered_for_an_adapter_lives_on_pods_that_hold_it(
    make_router: MakeRouter,
) -> None:
    urls = pods(6)
    pool = serving_pool(urls)
    store = PrefixStore()
    router = make_router(pool, store)
    entry, _ = store.register("rules", TEXT, replicas=2, scope=Scope("lora-a"))
    ring = pool.target_ring()
    assert ring is not None
    order = ring.preference(entry.route_key, 6)
    assert router.home_set(entry) == order[:2]  # no adapter view: the ring's homes
    holders = Holders({order[4]: {"lora-a"}, order[1]: {"lora-a"}, order[5]: {"lora-a"}})
    router.adapters = holders
    assert router.home_set(entry) == [order[1], order[4]]
    holders.held = {}
    assert router.home_set(entry) == order[:2]  # nobody holds it (yet): the ring's homes
