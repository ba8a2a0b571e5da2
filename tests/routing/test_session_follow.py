"""Session follow (routing contract 9h): a conversation's very next request (a chat, or a raw
prompt in a known chat template) goes where this sidecar sent its previous one; anything
else goes to the session's pod, as every sidecar computes."""

from __future__ import annotations

import pytest

from prefix_sidecar import _core
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.routing import organic
from prefix_sidecar.routing.anchors import AnchorTable
from prefix_sidecar.routing.router import Router
from prefix_sidecar.routing.session_follow import NO_MARK, SessionFollow

from .conftest import MakeRouter, pods, serving_pool
from .test_organic import Traffic, render


def test_only_the_very_next_request_is_recalled_and_the_map_is_bounded() -> None:
    follow = SessionFollow(capacity=3)
    follow.remember(1, "http://a", 0)  # a chat with no answer yet leaves 0
    assert follow.recall(1, 0) == "http://a"  # names 0 (one answer): the next request
    assert follow.recall(1, 1) is None  # names 1 (two answers): another sidecar sent one
    assert follow.recall(1, -1) is None  # the same request again (a retry): not a turn
    assert follow.recall(2, 0) is None  # never seen
    assert follow.recall(1, NO_MARK) is None  # names nothing: never followed
    follow.remember(1, "http://b", 1)
    assert follow.recall(1, 1) == "http://b"
    for session in (2, 3, 4):  # the least recently sent falls out first
        follow.remember(session, "http://c", 0)
    assert len(follow) == 3 and follow.recall(1, 1) is None
    assert follow.recall(4, 0) == "http://c"
    with pytest.raises(ValueError, match="capacity is 0"):
        SessionFollow(0)


def _moved_start(
    router: organic.OrganicRouter, ring: _core.HashTable, traffic: Traffic
) -> tuple[list[list[tuple[str, str]]], int, int]:
    """A session of tenant 0 whose start the balancer sent away from the session's pod
    (that pod made the busiest): the session's turns, where the start went, and the pod
    every sidecar computes for the session."""
    for _ in range(20):  # tenant 0's branch learnt, and its share the whole traffic
        router.for_chat(traffic.one_shot(0))
    turns = traffic.session(0, 4)
    keys = router.for_chat(turns[0])
    assert keys.start and (keys.mark, keys.after) == (0, -1)
    home = router.homes(ring, keys._replace(start=False))
    for _ in range(6):
        router.sent(ring, ring.members[home])
    start = router.homes(ring, keys)
    assert start != home
    router.sent(ring, ring.members[start], keys)
    return turns, start, home


def test_a_chats_next_request_follows_a_moved_start_and_others_go_home() -> None:
    ring = _core.Ring(pods(8))
    router = organic.OrganicRouter(AnchorTable())
    turns, start, home = _moved_start(router, ring, Traffic(5, 1))
    second = router.for_chat(turns[1])
    assert (second.mark, second.after) == (1, 0) and not second.start
    assert router.homes(ring, second) == start  # where its first exchange is cached
    router.sent(ring, ring.members[start], second)
    # Turn 4 arrives, turn 3 went through another sidecar: two answers more than this one
    # remembers, so it goes where every sidecar sends it.
    assert router.homes(ring, router.for_chat(turns[3])) == home
    assert router.decisions["later_followed"] == 1
    assert router.decisions["later_turn"] == 2  # and the helper's look at the home
    # Another sidecar, which never sent this session, sends turn 2 to the session's pod.
    other = organic.OrganicRouter(AnchorTable())
    for _ in range(20):
        other.for_chat(Traffic(5, 1).one_shot(0))
    assert other.homes(ring, other.for_chat(turns[1])) == home


def test_off_and_gone_and_raw_prompts_keep_the_sessions_pod() -> None:
    ring = _core.Ring(pods(8))
    off = organic.OrganicRouter(AnchorTable(), follow_sessions=False)
    turns, _, home = _moved_start(off, ring, Traffic(5, 1))
    assert off.follow is None and off.homes(ring, off.for_chat(turns[1])) == home
    # The pod the start went to left the fleet: the session's pod on the new ring.
    router = organic.OrganicRouter(AnchorTable())
    turns, start, home = _moved_start(router, ring, Traffic(5, 1))
    smaller = _core.Ring([url for url in ring.members if url != ring.members[start]])
    second = router.for_chat(turns[1])
    expected = smaller.session_home(second.family, 1, second.session)
    assert router.homes(smaller, second) == expected
    # A raw prompt's marks are read by its caller (Router.for_prompt, by its chat
    # template): given none, nothing is remembered and nothing followed.
    raw = router.for_prompt(render(turns[1]).encode())
    assert raw is not None and raw.mark == raw.after == NO_MARK
    assert router.follow is not None
    remembered = len(router.follow)
    router.sent(ring, ring.members[0], raw)
    assert len(router.follow) == remembered


def _plain(messages: list[tuple[str, str]]) -> str:
    """A conversation as one string in no known template: no turns to count."""
    return "".join(f"{role.upper()}: {text}\n" for role, text in messages) + "ASSISTANT:"


@pytest.mark.parametrize("shape", ["chat", "chatml", "plain"])
def test_the_router_follows_the_start_it_spread(make_router: MakeRouter, shape: str) -> None:
    """Through the sidecar's Router, as the Chat and Complete RPCs and the HTTP front call
    it: one tenant's sessions start on every pod of its home set, and each session's later
    turns stay on the pod its start went to (with follow off: on the session's pod). A raw
    prompt in a chat template (ChatML here) is followed by its assistant turns; one in no
    known template is not."""

    def decide(router: Router, messages: list[tuple[str, str]]) -> str:
        if shape == "chat":
            return router.for_chat(messages).backend
        return router.for_prompt((render if shape == "chatml" else _plain)(messages)).backend

    def run(follow: bool) -> tuple[set[str], list[set[str]]]:
        router = make_router(serving_pool(pods(4)), PrefixStore(), organic_follow_sessions=follow)
        traffic = Traffic(9, 1)
        for _ in range(30):
            decide(router, traffic.one_shot(0))
        sessions = [traffic.session(0, 3) for _ in range(12)]
        starts: set[str] = set()
        stayed = []
        for session in sessions:
            first = decide(router, session[0])
            starts.add(first)
            stayed.append({first} | {decide(router, turn) for turn in session[1:]})
        return starts, stayed

    if shape == "plain":  # nothing to count: follow changes nothing
        assert run(True) == run(False)
        return
    starts, stayed = run(True)
    assert len(starts) == 4  # the starts even out the whole fleet
    assert all(len(used) == 1 for used in stayed), stayed  # each session on its start's pod
    starts, stayed = run(False)
    assert len(starts) == 4 and any(len(used) == 2 for used in stayed)  # start, then home
