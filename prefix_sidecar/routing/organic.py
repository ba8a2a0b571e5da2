"""Organic routing: the FAMILY and SESSION keys of an unregistered prompt or chat (routing
contract 9; docs/organic-routing.md).

Family: what a tenant's or template's requests share (a chat's first message, a prompt's
first block). Session: what one conversation keeps across turns, keyed just past the
family's learnt anchor (`AnchorTable`); a chat without one uses its leading system
messages, a prompt without one the family key (one pod until it branches). The family's
share sizes its home set (9c) and a narrower session set (9f), in which `session_home` puts
each session on one pod, the same in every sidecar. A request that STARTS a flow has only
the family's head to find, so it may go to the least-counted pod of the home set (9f).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from prefix_sidecar import _core
from prefix_sidecar.routing.anchors import BLOCK_BYTES, LEARN_BLOCKS, AnchorTable
from prefix_sidecar.routing.chat_templates import NOT_FOLLOWED
from prefix_sidecar.routing.session_follow import NO_MARK, SessionFollow
from prefix_sidecar.routing.start_balance import FAR_MARGIN, FAR_MARGIN_PER_KB, StartBalancer

# Every sidecar of a fleet must use the same spreads and floor, as a session's later turns
# must reach the same pod; they are constants, not settings, so that they cannot disagree.
# Pods per fair share of traffic in a family's home set (9c) and its narrower session set
# (9f), whose size more sidecars estimate alike. docs/benchmarks.md "Organic routing: session
# sets": four sidecars' hit 0.982 of the ceiling, against 0.972 with one set at spread 3.
HOME_SPREAD = 4.0
SESSION_SPREAD = 1.5
# Organic picks' cap floor (min_cap), as cost.py REQUEST_CAP_FLOOR: an organic spill costs
# at most a session's history. In tokens each weighs ORGANIC_REQUEST_TOKENS.
LOAD_CAP_FLOOR = 8
# A flow's start goes to the least-counted pod of its home set (9f); docs/benchmarks.md
# "Organic routing: balanced starts": one sidecar's max/mean 1.21, against 1.39 off.
BALANCE_STARTS = True
# A conversation's next request goes where this sidecar sent its previous one (9h);
# docs/benchmarks.md "Session follow": one sidecar's max/mean 1.14 cold, against 1.22 off.
FOLLOW_SESSIONS = True
LEARN_MESSAGES = 32  # a chat's anchors are learnt in its first 32 messages
SESSION_BLOCKS = 2  # a prompt's session key is the chain key 2 blocks past its anchor
FIRST_BLOCKS = 64  # blocks hashed first (4 KB): enough when the anchor is among them
# The bytes of a prompt its organic keys can depend on: the learnt blocks and one more.
HEAD_BYTES = (LEARN_BLOCKS + 1) * BLOCK_BYTES
# A whole prompt that ends within 8 blocks (512 bytes) past its anchor starts a flow: a
# question fits, a question, an answer and the next question rarely do.
START_BLOCKS = 8


class OrganicKeys(NamedTuple):
    family: int
    session: int
    share: float  # the family's share of this sidecar's recent unregistered requests
    anchor: int  # the anchor's depth in blocks (a prompt) or messages (a chat); -1: none
    # Starts a flow (no history past its anchor): may go to any pod of its home set (9f).
    start: bool = False
    # The family's head (through the anchor) in bytes (a chat: characters): what a start
    # sent past the session set may have to recompute. 0: no anchor.
    head: int = 0
    # What tells a conversation's very next request (9h): the mark this request leaves
    # (a chat: its assistant messages; a raw prompt: its last assistant header's offset by
    # its chat template), and the one its previous request left. NO_MARK: no such structure.
    mark: int = NO_MARK
    after: int = NO_MARK


# What an organic decision was, for the decisions metric (a fixed set: bounded labels):
# - unanchored: the family has not branched yet (session key = family key: one pod);
# - later_turn: a request with history past its anchor, on its session's pod;
# - start_stayed: a flow's start left on its session's pod (nothing counted lower, or a
#   one-pod home set);
# - start_moved: a start sent to a less-loaded pod of its session set;
# - start_far: a start sent past the session set, where the head may be cold (9f);
# - later_followed: a conversation's next request sent where this sidecar sent its
#   previous one, not to its session's pod (9h).
DECISION_KINDS = (
    "unanchored",
    "later_turn",
    "start_stayed",
    "start_moved",
    "start_far",
    "later_followed",
)


def home_size(share: float, members: int, spread: float = HOME_SPREAD) -> int:
    """Contract 9c: min(N, max(1, ceil(spread * share * N))), in doubles in that order."""
    return min(members, max(1, math.ceil(spread * share * float(members))))


def message_keys(messages: Iterable[tuple[str, str]], limit: int) -> list[int]:
    """Contract 9d: chained keys of a chat's first `limit` messages, as blocks are chained:
    m_i = key(le64(m_{i-1}) || utf8(role) || 0x00 || utf8(content)), m_{-1} = 0."""
    keys: list[int] = []
    parent = 0
    route_key = _core.route_key
    for role, content in messages:
        if len(keys) == limit:
            break
        data = parent.to_bytes(8, "little") + role.encode("utf-8") + b"\x00"
        parent = route_key(data + content.encode("utf-8"))
        keys.append(parent)
    return keys


def leading_system(messages: Iterable[tuple[str, str]]) -> int:
    """How many messages open the chat with role system: its structural anchor."""
    count = 0
    for role, _ in messages:
        if role != "system":
            break
        count += 1
    return count


class OrganicRouter:
    """Keys for unregistered prompts and chats, and the table they are learnt in."""

    def __init__(
        self,
        table: AnchorTable,
        spread: float = HOME_SPREAD,
        *,
        session_spread: float = SESSION_SPREAD,
        balance_starts: bool = BALANCE_STARTS,
        follow_sessions: bool = FOLLOW_SESSIONS,
    ) -> None:
        self.table = table
        self.spread = spread
        self.session_spread = session_spread
        self.balancer = StartBalancer() if balance_starts else None
        self.follow = SessionFollow() if follow_sessions else None
        self._ring: _core.HashTable | None = None
        self._index: dict[str, int] = {}  # the ring's member -> index, for followed pods
        self.decisions = dict.fromkeys(DECISION_KINDS, 0)  # since start, by kind

    def for_chat(self, messages: list[tuple[str, str]], answers: int | None = None) -> OrganicKeys:
        """A chat's keys: its messages are its blocks. The anchor is the shallowest learnt
        branch among its first LEARN_MESSAGES messages (a few-shot template's last example),
        else its last leading system message (a tenant's system prompt). `answers`: the
        whole chat's assistant messages, when `messages` is only its first ones (default:
        counted in `messages`)."""
        if answers is None:
            answers = sum(1 for role, _ in messages if role == "assistant")
        chain = message_keys(messages, LEARN_MESSAGES + 1)
        if not chain:
            return OrganicKeys(0, 0, self.table.count(0), -1)
        table = self.table
        anchor = table.anchor(chain[:LEARN_MESSAGES])
        table.learn(chain, LEARN_MESSAGES if anchor < 0 else anchor + 2)
        anchor = table.anchor(chain[:LEARN_MESSAGES])
        if anchor < 0:
            anchor = leading_system(messages) - 1
        session = chain[anchor + 1] if anchor + 1 < len(chain) else chain[max(anchor, 0)]
        # A start: the chat ends with the message after its anchor (its first question).
        start = anchor >= 0 and len(messages) == anchor + 2
        head = sum(len(content) for _, content in messages[: anchor + 1]) if start else 0
        # a chat leaves its assistant messages; its previous request had one fewer (9h)
        return OrganicKeys(
            chain[0], session, table.count(chain[0]), anchor, start, head, answers, answers - 1
        )

    def for_prompt(self, data: bytes, marks: tuple[int, int] = NOT_FOLLOWED) -> OrganicKeys | None:
        """The prompt's keys, or None when it is shorter than one block (it then routes on
        its window key). `data` is the prompt's UTF-8, cut at HEAD_BYTES (shorter: the whole
        prompt). `marks`: the whole prompt's (mark, after) (`chat_templates.turn_marks`)."""
        # Most anchors sit in the first 4 KB: hash those first, the rest only when needed
        # (the result is the same as hashing LEARN_BLOCKS + 1 blocks at once).
        chain = _core.chain_keys(data, BLOCK_BYTES, FIRST_BLOCKS)
        if not chain:
            return None
        table = self.table
        anchor = table.anchor(chain)
        if len(chain) == FIRST_BLOCKS and (
            anchor < 0 or anchor + SESSION_BLOCKS + 2 > FIRST_BLOCKS
        ):
            chain = _core.chain_keys(data, BLOCK_BYTES, LEARN_BLOCKS + 1)
            if anchor < 0:
                anchor = table.anchor(chain[:LEARN_BLOCKS])
        # A family with an anchor records its prompts only up to the session key's block:
        # deeper blocks cannot make a shallower anchor, and recording them would churn the
        # table (and its dict resizes) with every session's history.
        table.learn(chain, LEARN_BLOCKS if anchor < 0 else anchor + SESSION_BLOCKS + 1)
        family = chain[0]
        anchor = table.anchor(chain[:LEARN_BLOCKS])
        if anchor < 0:
            session = family
        elif anchor + 1 < len(chain):
            # The block after the anchor may hold only a few bytes past the branch (the
            # shared "Turn 0: " of every session, say); the one after that holds 65 or more.
            session = chain[min(anchor + SESSION_BLOCKS, len(chain) - 1)]
        else:
            # The prompt ends inside the block after its anchor: key its tail.
            tail = data[(anchor + 1) * BLOCK_BYTES : (anchor + 2) * BLOCK_BYTES]
            session = _core.route_key(chain[anchor].to_bytes(8, "little") + tail)
        start = (
            anchor >= 0
            and len(data) < HEAD_BYTES
            and len(data) <= (anchor + 1 + START_BLOCKS) * BLOCK_BYTES
        )
        head = (anchor + 1) * BLOCK_BYTES if anchor >= 0 else 0
        return OrganicKeys(family, session, table.count(family), anchor, start, head, *marks)

    def homes(self, ring: _core.HashTable, keys: OrganicKeys) -> int:
        """The request's pod (member index): the session's pod in the family's session set,
        the first of its home set (contract 9b, 9f); a start, the least-loaded pod of the
        whole home set by this sidecar's counts (9f); a conversation's very next request,
        the pod this sidecar sent its previous one to (9h)."""
        members = len(ring.members)
        size = home_size(keys.share, members, self.spread)
        sessions = min(size, home_size(keys.share, members, self.session_spread))
        home = ring.session_home(keys.family, sessions, keys.session)
        decisions = self.decisions
        if keys.anchor < 0:
            decisions["unanchored"] += 1
            return home
        if not keys.start:
            followed = self._followed(ring, keys)
            if followed is not None and followed != home:
                decisions["later_followed"] += 1
                return followed
            decisions["later_turn"] += 1
            return home
        if size > 1 and self.balancer is not None:
            far = FAR_MARGIN + FAR_MARGIN_PER_KB * keys.head / 1024.0
            chosen = self.balancer.choose(ring, keys.family, size, home, sessions, far)
            if chosen != home:
                near = ring.members[chosen] in ring.preference(keys.family, sessions)
                decisions["start_moved" if near else "start_far"] += 1
                return chosen
        decisions["start_stayed"] += 1
        return home

    def sent(self, ring: _core.HashTable, backend: str, keys: OrganicKeys | None = None) -> None:
        """Count an organic request sent to `backend` (what starts are balanced on), and
        remember where a conversation went (`keys`: its keys), for its next request (9h)."""
        if self.balancer is not None:
            self.balancer.sent(ring, backend)
        follow = self.follow
        if follow is not None and keys is not None and keys.anchor >= 0 and keys.mark != NO_MARK:
            follow.remember(keys.session, backend, keys.mark)

    def _followed(self, ring: _core.HashTable, keys: OrganicKeys) -> int | None:
        """The member this sidecar sent the conversation's previous request to, if it did."""
        if self.follow is None:
            return None
        backend = self.follow.recall(keys.session, keys.after)  # None for NO_MARK
        if backend is None:
            return None
        if ring is not self._ring:
            self._ring = ring
            self._index = {url: i for i, url in enumerate(ring.members)}
        return self._index.get(backend)  # None: it left the fleet
