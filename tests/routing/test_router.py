"""The router on an in-memory pool and store: route keys (routing contract v1), the pick, the
failover order and the home sets, without a server."""

from __future__ import annotations

import random

import pytest

from prefix_sidecar import _core
from prefix_sidecar.config import ConfigError, build_config
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.routing.decision import NoBackendError
from prefix_sidecar.routing.pick import Branch
from prefix_sidecar.routing.policy import make_policy
from prefix_sidecar.routing.router import Router

from .conftest import MakeRouter, pods, serving_pool

RULES = "Store coupons apply before platform coupons. " * 40


def test_a_prefix_goes_where_the_cores_pick_says_then_fails_over_in_ring_order(
    make_router: MakeRouter,
) -> None:
    """Against the contract's formula, with loads: the chosen pod, then the rest of the
    key's first max(R, max_attempts) owners in ring order."""
    urls = pods(6)
    pool, store = serving_pool(urls), PrefixStore()
    router = make_router(pool, store, cap_floor=0, max_attempts=3)
    chance = random.Random(5)
    for n in range(40):
        entry = store.register(f"p{n}", f"{RULES} {n}", replicas=chance.randint(1, 5))[0]
        for url in urls:
            for _ in range(chance.randint(0, 3)):
                pool.acquire(url)
        ring, loads = pool.table.ring, pool.table.loads
        assert ring is not None
        decision = router.for_prefix(entry)
        member, branch = ring.pick(entry.route_key, loads, entry.replicas, 1.25, 0)
        assert (decision.backend, decision.branch) == (member, branch)
        assert type(decision.branch) is Branch
        order = ring.preference(entry.route_key, max(entry.replicas, 3))
        assert decision.preference == [member, *(u for u in order if u != member)]
        assert (decision.prefix, decision.route_key) == (entry, entry.route_key)
        assert decision.generation == pool.table.generation
        # no choice was made when the key's only home took it under its cap
        assert decision.forced == (entry.replicas == 1 and branch == Branch.HOME)
        for url in urls:
            while pool.table.loads[pool.table.index[url]]:
                pool.release(url)


def test_prompts_and_inline_prefixes_route_as_the_contract_says(
    make_router: MakeRouter,
) -> None:
    pool, store = serving_pool(pods(4)), PrefixStore()
    router = make_router(pool, store, route_window_bytes=64, unregistered_routing="window")
    entry = store.register("rules", RULES)[0]
    by_prompt = router.for_prompt(RULES + " is this allowed?")
    assert (by_prompt.prefix, by_prompt.route_key) == (entry, entry.route_key)
    inline = router.for_prefix_text(RULES)
    assert (inline.prefix, inline.route_key) == (entry, entry.route_key)
    unknown = "an unregistered head that is long enough to be cut at the window. " * 3
    raw = router.for_prompt(unknown)
    assert raw.prefix is None
    assert raw.route_key == _core.route_key(unknown.encode()[:64])
    text = router.for_prefix_text(unknown)
    assert (text.prefix, text.route_key) == (None, _core.route_key(unknown.encode()))
    assert raw.branch in (Branch.HOME, Branch.SPILL)
    assert raw.forced == (raw.branch == Branch.HOME)  # the window: one replica by default


def test_no_ring_is_no_backend(make_router: MakeRouter) -> None:
    router = make_router(BackendPool(), PrefixStore())
    with pytest.raises(NoBackendError, match="no healthy vLLM pod"):
        router.for_prompt("hello")


def test_every_setting_is_required() -> None:
    """No constructor default to disagree with the config's (it was load_cap_floor 0 vs 8)."""
    pool, store = serving_pool(pods(1)), PrefixStore()
    policy = make_policy("prefix_affinity", build_config({}))
    with pytest.raises(TypeError, match="required keyword-only"):
        Router(pool, store, policy)  # type: ignore[call-arg]


def test_home_sets_and_homed_tokens_follow_the_target_ring(make_router: MakeRouter) -> None:
    urls = pods(4)
    pool, store = serving_pool(urls), PrefixStore()
    router = make_router(pool, store, replicas=2)
    entries = [store.register(f"p{i}", f"{RULES} {i}".ljust(4_000))[0] for i in range(5)]
    ring = pool.target_ring()
    assert ring is not None and ring is pool.table.ring
    totals = dict.fromkeys(urls, 0)
    for entry in entries:
        homes = router.home_set(entry)
        assert homes == ring.preference(entry.route_key, 2)
        for url in homes:
            totals[url] += 1_000  # 4,000 bytes at 4 bytes per token
    assert router.homed_tokens() == totals


@pytest.mark.parametrize("hash_table", ["ring", "maglev"])
def test_unregistered_prompts_take_the_one_call_path_with_the_same_answer(
    make_router: MakeRouter, hash_table: str
) -> None:
    """for_prompt hashes and picks in one core call (pick_bytes, the pool's total): the
    decision is the contract's pick of key(window) over the loads, on either table."""
    urls = pods(7)
    pool, store = serving_pool(urls, hash_table=hash_table), PrefixStore()
    router = make_router(
        pool,
        store,
        route_window_bytes=32,
        cap_floor=2,
        max_attempts=3,
        unregistered_routing="window",
    )
    ring = pool.table.ring
    assert ring is not None
    assert type(ring).__name__ == ("Maglev" if hash_table == "maglev" else "Ring")
    chance = random.Random(11)
    for n in range(60):
        url = chance.choice(urls)
        if chance.random() < 0.7:
            pool.acquire(url)
        else:
            pool.release(url)
        if n % 7 == 0:
            pool.report_load(chance.choice(urls), chance.choice([None, 0, 4, 12]))
        prompt = f"tenant {n} asks: what does coupon {n * 37} cover? " * 2
        decision = router.for_prompt(prompt)
        key = _core.route_key(prompt.encode()[:32])
        loads = pool.table.loads
        assert pool.table.total == sum(loads)
        assert (decision.backend, decision.branch) == ring.pick(key, list(loads), 1, 1.25, 2)
        assert decision.route_key == key
        order = ring.preference(key, 3)
        assert decision.preference == [
            decision.backend,
            *(u for u in order if u != decision.backend),
        ]


def test_the_config_chooses_the_table(make_router: MakeRouter) -> None:
    assert build_config({"hash_table": "maglev"}).hash_table == "maglev"
    assert build_config({}).hash_table == "ring"
    with pytest.raises(ConfigError, match="hash_table"):
        build_config({"hash_table": "chord"})
    with pytest.raises(ValueError, match="unknown hash table 'chord'"):
        BackendPool(hash_table="chord")


def test_an_organic_start_is_a_choice_and_a_later_turn_is_not(make_router: MakeRouter) -> None:
    """A flow's start picks the least-loaded pod of its home set (contract 9f): a choice. A
    later turn goes to its session's pod: no choice unless it spilled."""
    router = make_router(serving_pool(pods(4)), PrefixStore())
    system = ("system", "You answer questions about the shop's return policy. " * 12)
    start = router.for_chat([system, ("user", "Can I return shoes after 30 days?")])
    assert not start.forced
    later = router.for_chat(
        [
            system,
            ("user", "Can I return shoes after 30 days?"),
            ("assistant", "Only with a receipt, and within 60 days."),
            ("user", "And sandals?"),
        ]
    )
    assert later.branch == Branch.HOME and later.forced
