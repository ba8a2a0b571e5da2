"""Flow starts (routing contract 9f): which requests start a flow, and that a start goes to
the least-loaded pod of its family's home set while every later turn stays on its
session's pod. In memory: the router on a pool of serving pods, zero loads."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from prefix_sidecar import _core
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.routing import organic
from prefix_sidecar.routing.anchors import BLOCK_BYTES, AnchorTable
from prefix_sidecar.routing.start_balance import DECAY, StartBalancer

from .conftest import MakeRouter, pods, serving_pool
from .test_organic import Traffic, later_turns_pods, prose, render, route


def learnt(chat: bool) -> tuple[organic.OrganicRouter, Traffic]:
    """A router that has seen tenant 0 branch (its anchor is learnt)."""
    router = organic.OrganicRouter(AnchorTable())
    traffic = Traffic(11, 2)
    for _ in range(20):
        messages = traffic.one_shot(0)
        if chat:
            router.for_chat(messages)
        else:
            router.for_prompt(render(messages).encode())
    return router, traffic


def test_which_chats_start_a_flow() -> None:
    router, traffic = learnt(chat=True)
    turns = traffic.session(0, 3)
    assert router.for_chat(turns[0]).start  # system, user: a first question
    assert not router.for_chat(turns[1]).start  # an answer and a second question follow
    assert not router.for_chat(turns[2]).start
    assert not router.for_chat([("user", "no system message")]).start  # no anchor
    # A few-shot template: once its branch after the last example is learnt, a query is a
    # start; before that the anchor is the system message and the examples follow it.
    rng = random.Random(3)
    template = [("system", "Template: classify.")]
    for i in range(3):
        template += [("user", f"Example {i}: " + prose(rng, 200)), ("assistant", "positive")]
    first = router.for_chat([*template, ("user", prose(rng, 100))])
    assert (first.anchor, first.start) == (0, False)
    for _ in range(3):
        keys = router.for_chat([*template, ("user", prose(rng, 100))])
    assert (keys.anchor, keys.start) == (len(template) - 1, True)


def test_which_raw_prompts_start_a_flow() -> None:
    router, traffic = learnt(chat=False)
    system = traffic.systems[0]
    head = render([("system", system), ("user", "")]).encode()
    question = prose(random.Random(1), 300)
    keys = router.for_prompt(render([("system", system), ("user", question)]).encode())
    assert keys is not None and keys.anchor >= 0 and keys.start
    # The rule: the whole prompt ends within START_BLOCKS blocks past its anchor block.
    limit = (keys.anchor + 1 + organic.START_BLOCKS) * BLOCK_BYTES
    question = "q" * (limit - len(head))
    at_limit = render([("system", system), ("user", question)]).encode()[:limit]
    over = render([("system", system), ("user", question + "x" * 80)]).encode()
    at, past = router.for_prompt(at_limit), router.for_prompt(over)
    assert at is not None and past is not None and at.anchor == past.anchor == keys.anchor
    assert len(at_limit) == limit and at.start
    assert len(over) > limit and not past.start
    turns = traffic.session(0, 2)
    second = router.for_prompt(render(turns[1]).encode())
    assert second is not None and not second.start  # it carries an answer
    # A prompt cut at HEAD_BYTES is not whole: never a start, whatever its anchor.
    cut = (render([("system", system), ("user", "y" * 9000)]).encode())[: organic.HEAD_BYTES]
    long = router.for_prompt(cut)
    assert long is not None and not long.start
    # No anchor (a family that never branched): not a start, it stays on one pod.
    fresh = router.for_prompt(b"a family never seen before, " * 20)
    assert fresh is not None and (fresh.anchor, fresh.start) == (-1, False)


@pytest.mark.parametrize("hash_table", ["ring", "maglev"])
@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat"])
def test_starts_even_out_the_home_set_and_later_turns_keep_their_pod(
    make_router: MakeRouter, chat: bool, hash_table: str
) -> None:
    """One tenant, 8 pods: its one-shots spread evenly over its home set (within a few
    requests of each other), while with starts unbalanced they follow the sessions' hash;
    every session's turns after the first stay on one pod, the session's home."""

    def run(balance: bool) -> tuple[Counter[str], dict[int, set[str]]]:
        pool = serving_pool(pods(8), hash_table=hash_table)
        router = make_router(pool, PrefixStore(), organic_balance_starts=balance)
        traffic = Traffic(21, 1)
        sent: Counter[str] = Counter()
        for _ in range(400):
            sent[route(router, traffic.one_shot(0), chat)] += 1
        return sent, later_turns_pods(router, [traffic.session(0, 4) for _ in range(16)], chat)

    balanced, later = run(True)
    hashed, _ = run(False)
    assert all(len(used) == 1 for used in later.values()), later
    assert len(balanced) == 8  # share 1: the whole fleet is the home set
    # Decayed counts even out the recent requests; over the whole run within a few %.
    assert max(balanced.values()) - min(balanced.values()) <= 8, balanced
    assert max(hashed.values()) - min(hashed.values()) > 8, hashed


def test_a_start_prefers_its_sessions_pod_on_a_near_tie() -> None:
    ring = _core.Ring(pods(4))
    balancer = StartBalancer()
    family, homes = 77, 4
    home = ring.session_home(family, homes, 12345)
    assert balancer.choose(ring, family, homes, home) == home  # all zero: stay
    for _ in range(2):  # the home is ~2 (decayed) requests ahead: move
        balancer.sent(ring, ring.members[home])
    moved = balancer.choose(ring, family, homes, home)
    assert moved != home
    # The least counted, ties in the family's order: the family's first pod not counted.
    order = [ring.members.index(url) for url in ring.preference(family, homes)]
    assert moved == next(member for member in order if member != home)
    half = StartBalancer(margin=2.0)
    for _ in range(2):  # 1.995 requests ahead: within the margin
        half.sent(ring, ring.members[home])
    assert half.choose(ring, family, homes, home) == home  # within the margin: stay


def test_counts_decay_follow_the_ring_and_stay_bounded() -> None:
    ring = _core.Ring(pods(4))
    balancer = StartBalancer()
    first = ring.members[0]
    balancer.sent(ring, first)
    for _ in range(139):
        balancer.sent(ring, ring.members[1])
    # Every decision after its own (and its own) decays it once: 140 in all.
    assert balancer.counts()[first] == pytest.approx(DECAY**140, rel=1e-9)
    assert abs(DECAY**139 - 0.5) < 0.01  # a half-life of 139 decisions
    # Long runs rescale instead of overflowing; relative counts are kept.
    for i in range(200_000):
        balancer.sent(ring, ring.members[i % 4])
    counts = balancer.counts()
    assert len(counts) == 4 and all(0 < c < 1 / (1 - DECAY) + 1 for c in counts.values())
    # A new ring: the pods still in it keep their counts, a new pod starts at 0.
    grown = _core.Ring([*pods(3), "http://10.0.0.9:8000"])
    before = balancer.counts()
    balancer.sent(grown, "http://10.0.0.9:8000")
    after = balancer.counts()
    assert set(after) == set(grown.members)
    assert after["http://10.0.0.1:8000"] == pytest.approx(before["http://10.0.0.1:8000"] * DECAY)
    assert after["http://10.0.0.9:8000"] == pytest.approx(DECAY)  # one request, decayed once
    balancer.sent(grown, "http://10.9.9.9:8000")  # not a member: not counted, no error
    assert set(balancer.counts()) == set(grown.members)


@pytest.mark.parametrize(("decay", "margin"), [(0.0, 1.0), (1.5, 1.0), (0.9, -1.0)])
def test_bad_settings_are_refused(decay: float, margin: float) -> None:
    with pytest.raises(ValueError, match=r"decay|margin"):
        StartBalancer(decay, margin)


def test_a_start_leaves_the_session_set_only_by_the_far_margin() -> None:
    """Pods of the home set past the session set may have evicted the family's head: a
    start goes there only when it is counted lower than the session's home by `far_margin`,
    while a pod of the session set needs MARGIN only."""
    ring = _core.Ring(pods(4))
    family, homes = 77, 4
    order = [ring.members.index(url) for url in ring.preference(family, homes)]
    home = order[0]

    def counted(at_home: int, at_second: int) -> StartBalancer:
        balancer = StartBalancer(decay=1.0)  # no decay: the counts are the requests sent
        for member, times in ((home, at_home), (order[1], at_second)):
            for _ in range(times):
                balancer.sent(ring, ring.members[member])
        return balancer

    # The second pod of the session set is as busy as the home; the two past it are idle.
    balancer = counted(3, 3)
    assert balancer.choose(ring, family, homes, home, sessions=2, far_margin=5.0) == home
    assert balancer.choose(ring, family, homes, home, sessions=2, far_margin=3.0) == order[2]
    assert balancer.choose(ring, family, homes, home) == order[2]  # one margin for all
    # Within the session set MARGIN is enough, whatever the far margin.
    balancer = counted(3, 0)
    assert balancer.choose(ring, family, homes, home, sessions=2, far_margin=99.0) == order[1]
    # The least counted of those that qualify: a near pod beats an idler far one that
    # does not clear its margin.
    balancer = counted(4, 2)
    assert balancer.choose(ring, family, homes, home, sessions=2, far_margin=5.0) == order[1]


def test_every_decision_is_counted_by_its_kind() -> None:
    """`decisions` (the organic decisions metric): unanchored, later_turn, and a start that
    stayed, moved within its session set, or went past it."""
    ring = _core.Ring(pods(4))
    router = organic.OrganicRouter(AnchorTable())
    family = 91
    # share 0.5 on 4 pods: a home set of all 4, a session set of ceil(1.5 x 0.5 x 4) = 3
    order = [ring.members.index(url) for url in ring.preference(family, 4)]

    def keys(*, anchor: int = 0, start: bool = True, share: float = 0.5) -> organic.OrganicKeys:
        return organic.OrganicKeys(family, 7, share, anchor, start)

    home = router.homes(ring, keys(start=False))  # nothing counted yet
    assert home in order[:3]
    router.homes(ring, keys(anchor=-1, start=False))
    router.homes(ring, keys(share=0.01))  # a one-pod home set: nowhere to go
    assert router.homes(ring, keys()) == home  # all counted alike: it stays
    router.sent(ring, ring.members[home])
    router.sent(ring, ring.members[home])
    moved = router.homes(ring, keys())
    assert moved != home and moved in order[:3]
    for member in order[:3]:  # the session set busy, the fourth pod idle
        for _ in range(4):
            router.sent(ring, ring.members[member])
    assert router.homes(ring, keys()) == order[3]
    assert router.decisions == {
        "unanchored": 1,
        "later_turn": 1,
        "start_stayed": 2,
        "start_moved": 1,
        "start_far": 1,
        "later_followed": 0,
    }


@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat"])
def test_sessions_live_on_the_session_set_and_starts_use_the_home_set(chat: bool) -> None:
    """A tenant with about a quarter of the traffic on 8 pods: its home set is
    ceil(4 x share x 8) = 7-8 pods, its session set ceil(1.5 x share x 8) = 3-4, the family's
    first pods. Every later turn of its sessions lands in the session set; its starts,
    balanced, reach pods past it."""
    ring = _core.Ring(pods(8))
    router = organic.OrganicRouter(AnchorTable())
    traffic = Traffic(31, 7)
    rng = random.Random(8)

    def decide(messages: list[tuple[str, str]]) -> tuple[int, organic.OrganicKeys]:
        keys = router.for_chat(messages) if chat else router.for_prompt(render(messages).encode())
        assert keys is not None
        member = router.homes(ring, keys)
        router.sent(ring, ring.members[member])
        return member, keys

    starts: set[int] = set()
    for _ in range(600):
        tenant = 0 if rng.random() < 0.25 else rng.randint(1, 6)
        member, keys = decide(traffic.one_shot(tenant))
        if tenant == 0:
            starts.add(member)
    keys = decide(traffic.one_shot(0))[1]
    homes = organic.home_size(keys.share, 8, organic.HOME_SPREAD)
    sessions = organic.home_size(keys.share, 8, organic.SESSION_SPREAD)
    assert homes >= 7 and sessions <= 4, (keys.share, homes, sessions)
    session_set = {ring.members.index(url) for url in ring.preference(keys.family, sessions)}
    later: set[int] = set()
    for _ in range(12):
        for turn, messages in enumerate(traffic.session(0, 3)):
            member, keys = decide(messages)
            assert keys.start == (turn == 0)
            if turn:
                later.add(member)
    assert later <= session_set, (later, session_set)
    assert len(starts - session_set) >= 3, starts


def test_a_starts_head_is_what_it_shares_with_its_family() -> None:
    """`head`: the bytes through the anchor (a raw prompt: whole blocks; a chat: the
    messages through the anchor, in characters), 0 without an anchor."""
    for chat in (False, True):
        router, traffic = learnt(chat)
        messages = traffic.one_shot(0)
        if chat:
            keys = router.for_chat(messages)
            assert keys.head == len(traffic.systems[0])
        else:
            found = router.for_prompt(render(messages).encode())
            assert found is not None
            keys = found
            head = render([("system", traffic.systems[0]), ("user", "")]).encode()
            assert keys.head == (keys.anchor + 1) * BLOCK_BYTES
            assert keys.head <= len(head) + 2 * BLOCK_BYTES
        assert keys.start
    fresh = organic.OrganicRouter(AnchorTable()).for_prompt(b"never seen before, " * 20)
    assert fresh is not None and fresh.head == 0
