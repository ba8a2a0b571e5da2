"""Organic routing (routing contract 9) through the router, on an in-memory pool: sessions
stay together, tenants spread by share, independent routers agree, the table stays bounded,
and the fallbacks. No server: the loads are all zero unless a test sets them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from prefix_sidecar import _core
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.routing import organic
from prefix_sidecar.routing.anchors import BLOCK_BYTES, LEARN_BLOCKS, MIN_FANOUT, AnchorTable
from prefix_sidecar.routing.router import Router

from .conftest import MakeRouter, pods, serving_pool

GOLDEN = Path(__file__).resolve().parents[1] / "core" / "golden.json"
WORDS = [
    "coupon",
    "stacking",
    "voucher",
    "refund",
    "parcel",
    "jacket",
    "discount",
    "policy",
    "store",
    "platform",
]


def prose(rng: random.Random, size: int) -> str:
    text = ""
    while len(text) < size:
        text += " ".join(rng.choice(WORDS) for _ in range(9)) + ". "
    return text[:size]


def render(messages: list[tuple[str, str]]) -> str:
    """ChatML, as the emulator renders a chat for the pod (system messages first)."""
    parts = [f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


class Traffic:
    """Tenants with system prompts, their sessions (turns growing) and one-shot questions."""

    def __init__(self, seed: int, tenants: int) -> None:
        self.rng = random.Random(seed)
        self.systems = [
            f"You are the assistant of store #{t}. " + prose(self.rng, self.rng.randint(300, 3000))
            for t in range(tenants)
        ]

    def one_shot(self, tenant: int) -> list[tuple[str, str]]:
        return [("system", self.systems[tenant]), ("user", prose(self.rng, 200))]

    def session(self, tenant: int, turns: int) -> list[list[tuple[str, str]]]:
        history = [("system", self.systems[tenant])]
        result = []
        for turn in range(turns):
            if turn:
                history.append(("assistant", "Answer: " + prose(self.rng, 400)))
            history.append(("user", f"Turn {turn}: " + prose(self.rng, 150)))
            result.append(list(history))
        return result


def route(router: Router, messages: list[tuple[str, str]], chat: bool) -> str:
    decision = router.for_chat(messages) if chat else router.for_prompt(render(messages))
    return decision.backend


def later_turns_pods(
    router: Router, sessions: list[list[list[tuple[str, str]]]], chat: bool
) -> dict[int, set[str]]:
    """Session index -> the pods its turns after the first went to, the sessions' turns
    routed interleaved, as concurrent chats arrive."""
    where: dict[int, set[str]] = {i: set() for i in range(len(sessions))}
    for turn in range(max(map(len, sessions))):
        for i, session in enumerate(sessions):
            backend = route(router, session[turn], chat)
            if turn:
                where[i].add(backend)
    return where


@pytest.mark.parametrize("hash_table", ["ring", "maglev"])
@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat"])
def test_a_sessions_turns_land_on_one_pod_and_sessions_spread(
    make_router: MakeRouter, chat: bool, hash_table: str
) -> None:
    """Interleaved sessions of one hot tenant: every turn of a session after its first on
    one pod, while the tenant's sessions use several pods; on either routing table. (The
    first turn starts the flow: it goes to the least-loaded pod of the home set.)"""
    router = make_router(serving_pool(pods(8), hash_table=hash_table), PrefixStore())
    traffic = Traffic(1, 3)
    for _ in range(120):  # one-shot questions: the branch point and the share are learnt
        route(router, traffic.one_shot(0), chat)
    where = later_turns_pods(router, [traffic.session(0, 6) for _ in range(24)], chat)
    assert all(len(pods_used) == 1 for pods_used in where.values()), where
    assert len(set.union(*where.values())) >= 4  # share ~1: the home set is most of the fleet


@pytest.mark.parametrize("hash_table", ["ring", "maglev"])
@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat"])
def test_tenants_spread_by_their_share(
    make_router: MakeRouter, chat: bool, hash_table: str
) -> None:
    pool = serving_pool(pods(8), hash_table=hash_table)
    router = make_router(pool, PrefixStore(), organic_home_spread=2.0)
    traffic = Traffic(2, 6)
    rng = random.Random(3)
    used: dict[int, set[str]] = {t: set() for t in range(6)}
    for _ in range(600):
        # Tenant 0 sends half the traffic, the 5 others a tenth each.
        tenant = 0 if rng.random() < 0.5 else rng.randint(1, 5)
        used[tenant].add(route(router, traffic.one_shot(tenant), chat))
    # Home sizes: ceil(2 x 0.5 x 8) = 8 pods for the hot tenant, ceil(2 x 0.1 x 8) = 2 others.
    assert len(used[0]) >= 7, used[0]
    assert all(len(used[t]) <= 3 for t in range(1, 6)), used


def test_independent_routers_fed_the_same_statistics_agree() -> None:
    """Routers fed the same traffic decide alike, to the bit. Routers that each see their own
    random quarter of it learn the same anchors, so the same keys; only a family share near
    a home-size boundary can differ, which moves a few sessions."""
    traffic = Traffic(4, 8)
    rng = random.Random(5)
    head = (LEARN_BLOCKS + 1) * BLOCK_BYTES
    stream = []
    for _ in range(4800):  # 1,200 per router: shares within a few % of each other
        tenant = min(int(rng.expovariate(0.5)), 7)
        stream.append(render(traffic.one_shot(tenant)).encode()[:head])
    ring = _core.Ring(pods(8))
    same = [organic.OrganicRouter(AnchorTable()) for _ in range(2)]
    for data in stream[:600]:
        decided = [(r.homes(ring, k), k) for r in same if (k := r.for_prompt(data))]
        assert decided[0] == decided[1]
    quarters = [organic.OrganicRouter(AnchorTable()) for _ in range(4)]
    for data in stream:
        rng.choice(quarters).for_prompt(data)
    agree = total = 0
    for tenant in range(8):
        for _ in range(10):
            data = render(traffic.one_shot(tenant)).encode()[:head]
            keys = [r.for_prompt(data) for r in quarters]
            assert all(k is not None for k in keys)
            anchors = {k.anchor for k in keys if k is not None}
            families = {k.family for k in keys if k is not None}
            sessions = {k.session for k in keys if k is not None}
            assert len(anchors) == len(families) == len(sessions) == 1, (tenant, anchors)
            homes = {r.homes(ring, k) for r, k in zip(quarters, keys, strict=True) if k}
            agree += len(homes) == 1
            total += 1
    assert agree / total >= 0.85, agree / total


def test_the_table_stays_bounded_under_churn() -> None:
    """Every prompt new (no two share a block): the table never holds more than its bound."""
    table = AnchorTable(max_blocks=512)
    rng = random.Random(6)
    for n in range(3000):
        data = rng.randbytes(rng.randint(64, (LEARN_BLOCKS + 1) * BLOCK_BYTES))
        table.learn(_core.chain_keys(data, BLOCK_BYTES, LEARN_BLOCKS + 1), LEARN_BLOCKS)
        table.count(rng.getrandbits(64))
        assert len(table) <= table.max_entries, n
    # Branches too: many heads, each branching many ways.
    heads = [rng.randbytes(640) for _ in range(400)]
    for _ in range(6000):
        data = rng.choice(heads) + rng.randbytes(200)
        table.learn(_core.chain_keys(data, BLOCK_BYTES, LEARN_BLOCKS + 1), LEARN_BLOCKS)
        assert len(table) <= table.max_entries
    assert table.max_entries == 2 * (512 + LEARN_BLOCKS) + 2 * (64 + 64)


def test_an_anchor_is_where_prompts_branch() -> None:
    table = AnchorTable()
    head = b"h" * (10 * BLOCK_BYTES)  # ten shared blocks
    chains = [_core.chain_keys(head + bytes([i]) * 300, BLOCK_BYTES, 20) for i in range(3)]
    table.learn(chains[0])
    assert table.anchor(chains[0]) == -1  # one prompt: no branch yet
    table.learn(chains[1])
    assert table.fanout(chains[0][9]) == MIN_FANOUT == 2
    assert table.anchor(chains[1]) == 9  # the last shared block
    table.learn(chains[1])  # a repeat adds nothing
    assert table.fanout(chains[0][9]) == 2
    table.learn(chains[2])
    assert table.fanout(chains[0][9]) == 3
    # A longer prompt that extends a known one is no branch.
    longer = _core.chain_keys(head + bytes([0]) * 600, BLOCK_BYTES, 20)
    table.learn(longer)
    assert table.anchor(longer) == 9 and table.fanout(chains[0][12]) == 0


def test_fallbacks(make_router: MakeRouter) -> None:
    router = make_router(serving_pool(pods(6)), PrefixStore())
    short = router.for_prompt("shorter than a block")
    assert short.route_key == _core.route_key(b"shorter than a block")  # the window key
    # A family that never branched: every prompt of it on one pod (its session key is the
    # family's), whatever follows its first block.
    head = "A brand-new family's first block, sixty-four bytes or a bit more. "
    decisions = [router.for_prompt(head * 2 + str(i)) for i in range(1)]
    family = _core.chain_keys((head * 2).encode(), BLOCK_BYTES, 1)[0]
    assert decisions[0].route_key == family
    # Window mode: the v1 routes, a chat on its first message.
    window = make_router(serving_pool(pods(6)), PrefixStore(), unregistered_routing="window")
    messages = [("system", "rules " * 50), ("user", "hello")]
    assert window.for_chat(messages).route_key == _core.route_key(("rules " * 50).encode())
    assert window.organic is None and not window.follows_conversations
    assert router.follows_conversations
    off = make_router(serving_pool(pods(6)), PrefixStore(), organic_follow_sessions=False)
    assert not off.follows_conversations


@pytest.mark.parametrize("policy", ["round_robin", "random", "least_loaded"])
def test_a_policy_that_ignores_the_key_gets_no_organic_keys(
    make_router: MakeRouter, policy: str
) -> None:
    """A baseline picks without the key: organic keys would be wasted work, and their
    decision counts (and session-follow memory) would describe picks nobody made."""
    router = make_router(serving_pool(pods(4)), PrefixStore(), policy=policy)
    assert router.organic is None
    assert router.head_bytes == router.route_window_bytes
    decision = router.for_chat([("system", "rules " * 50), ("user", "hello")])
    assert decision.route_key == _core.route_key(("rules " * 50).encode())
    keyed = make_router(serving_pool(pods(4)), PrefixStore(), policy="consistent_hash")
    assert keyed.organic is not None


def test_a_registered_system_message_routes_as_its_prefix(make_router: MakeRouter) -> None:
    store = PrefixStore()
    router = make_router(serving_pool(pods(4)), store)
    entry = store.register("rules", "Registered rules. " * 30)[0]
    decision = router.for_chat([("system", "Registered rules. " * 30), ("user", "hi")])
    assert (decision.prefix, decision.route_key) == (entry, entry.route_key)


def test_a_few_shot_templates_queries_spread_once_learnt(make_router: MakeRouter) -> None:
    """All of a template's messages are shared: its branch is after the last example, so
    the query is the session key (by structure alone it would be the first example)."""
    router = make_router(serving_pool(pods(8)), PrefixStore())
    rng = random.Random(7)
    template = [("system", "Template: classify.")]
    for i in range(4):
        template += [("user", f"Example {i}: " + prose(rng, 200)), ("assistant", "positive")]
    used = {router.for_chat([*template, ("user", prose(rng, 120))]).backend for _ in range(80)}
    assert len(used) >= 4  # the template's share is 1: its home set is the fleet


def test_a_spilled_session_keeps_spilling_to_one_pod(make_router: MakeRouter) -> None:
    pool = serving_pool(pods(6))
    router = make_router(pool, PrefixStore(), organic_load_cap_floor=0)
    traffic = Traffic(8, 1)
    route(router, traffic.one_shot(0), chat=True)
    turns = traffic.session(0, 6)
    home = router.for_chat(turns[1]).backend  # a later turn: the session's own pod
    for _ in range(30):
        pool.acquire(home)  # the home pod is far over its cap
    spilled = {router.for_chat(turn).backend for turn in turns[2:]}
    assert len(spilled) == 1 and home not in spilled


def test_counting_tokens_a_cold_prompt_in_flight_does_not_push_a_session_off_its_pod(
    make_router: MakeRouter,
) -> None:
    """The organic floor weighs each of its requests as a later turn: one cold system prompt
    of ~750 tokens on the session's pod leaves it under its cap (weighed as thin queries the
    floor was 1,024 tokens, and bench organic spilled 80 of 548 requests cold)."""
    pool = serving_pool(pods(6), load_unit="tokens")
    router = make_router(pool, PrefixStore())
    traffic = Traffic(8, 1)
    route(router, traffic.one_shot(0), chat=True)
    turns = traffic.session(0, 6)
    home = router.for_chat(turns[1]).backend
    pool.acquire(home, prefill=750)  # someone's cold start computing there
    pool.acquire(home, prefill=512)  # and a later turn
    assert {router.for_chat(turn).backend for turn in turns[2:]} == {home}
    for _ in range(8):  # a queue of eight more turns: past the floor, the session spills
        pool.acquire(home, prefill=512)
    assert router.for_chat(turns[2]).backend != home


def test_the_contracts_vectors_for_the_routing_side() -> None:
    """Parameters and the key functions kept in sidecar/routing, against golden.json."""
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))["organic"]
    assert (golden["block_bytes"], golden["learn_blocks"]) == (BLOCK_BYTES, LEARN_BLOCKS)
    assert golden["learn_messages"] == organic.LEARN_MESSAGES
    for case in golden["home_sizes"]:
        size = organic.home_size(case["share"], case["members"], case["spread"])
        assert size == case["size"], case
    for case in golden["messages"]:
        messages = [(role, text) for role, text in case["messages"]]
        assert organic.message_keys(messages, 32) == [int(k) for k in case["keys"]]


def test_no_ring_is_no_backend(make_router: MakeRouter) -> None:
    from prefix_sidecar.routing.decision import NoBackendError

    router = make_router(BackendPool(), PrefixStore())
    with pytest.raises(NoBackendError):
        router.for_chat([("system", "x" * 100), ("user", "y")])


def test_hashing_the_first_4_kb_first_decides_as_hashing_it_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """for_prompt hashes 64 blocks, then the rest only when the anchor is not among them:
    the same keys as a router that hashes LEARN_BLOCKS + 1 at once, system prompts of
    0.3-7 KB (anchors on both sides of 4 KB), new families and repeats included."""
    rng = random.Random(9)
    systems = [prose(rng, rng.randint(300, 7000)) for _ in range(12)]
    prompts = []
    for _ in range(1500):
        system = rng.choice(systems)
        tail = prose(rng, rng.randint(1, 3000)) if rng.random() < 0.9 else ""
        prompts.append(render([("system", system), ("user", tail)]).encode())
    prompts += [rng.randbytes(rng.randint(0, 9000)) for _ in range(200)]
    rng.shuffle(prompts)
    staged, whole = organic.OrganicRouter(AnchorTable()), organic.OrganicRouter(AnchorTable())
    for data in prompts:
        head = data[: (LEARN_BLOCKS + 1) * BLOCK_BYTES]
        expected = None
        with monkeypatch.context() as patch:
            patch.setattr(organic, "FIRST_BLOCKS", LEARN_BLOCKS + 1)
            expected = whole.for_prompt(head)
        assert staged.for_prompt(head) == expected
