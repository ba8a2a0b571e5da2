"""Organic routing: the two keys of an unregistered prompt or chat (routing contract 8).

Every unregistered request gets a FAMILY key (what a tenant's or a template's requests
share) and a SESSION key (what one conversation keeps across its turns, and what differs
between conversations of one family):

- a chat (messages): family = key of its system messages, session = key of its first user
  message under that family. Structure tells where the stable part ends; nothing is learnt.
- a raw prompt: its chained block keys (`_core.chain_keys`); family = the first block's
  key; session = the key of the block right after the prompt's learnt anchor (the branch
  point where the family's prompts diverge, `AnchorTable`). With no anchor learnt yet the
  session key is the family's, so a new family stays on one pod until it branches.

The family's share of recent requests sizes its home set: `home_size` pods, the first of
preference(family) (contract 8c), so a hot tenant spreads over several pods and a rare one
keeps one. The session picks its pod among them by consistent hashing restricted to the
home set (`Ring.session_home`, 8b): a session's turns land on one pod, and the same pod
in every sidecar. The bounded-load pick (`pick_among` over that one pod, 4b) spills a
session in its own key's preference order, so a spilled session keeps spilling to one pod.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from sidecar import _core
from sidecar.routing.anchors import BLOCK_BYTES, LEARN_BLOCKS, AnchorTable

HOME_SPREAD = 2.0  # pods per "fair share" of traffic a family's home set gets (8c)


class OrganicKeys(NamedTuple):
    family: int
    session: int
    share: float  # the family's share of this sidecar's recent unregistered requests
    anchor: int  # the anchor's block depth (raw prompts), -1 for none or for a chat


def home_size(share: float, members: int, spread: float = HOME_SPREAD) -> int:
    """Contract 8c: min(N, max(1, ceil(spread * share * N))), in doubles in that order."""
    return min(members, max(1, math.ceil(spread * share * float(members))))


def chat_family(system: Iterable[str]) -> int:
    """Contract 8d: key(utf8(s_1) || 0x00 || utf8(s_2) || 0x00 ...) over the system
    messages' texts in order; 0 (key of nothing) for a chat without one."""
    data = b"".join(text.encode("utf-8") + b"\x00" for text in system)
    return _core.route_key(data)


def session_key(family: int, text: str) -> int:
    """Contract 8d: key(le64(family) || utf8(first user message))."""
    return _core.route_key(family.to_bytes(8, "little") + text.encode("utf-8"))


def chat_parts(messages: Iterable[tuple[str, str]]) -> tuple[list[str], str | None]:
    """(the system messages' texts, the first user message's text or None)."""
    system: list[str] = []
    user: str | None = None
    for role, content in messages:
        if role == "system":
            system.append(content)
        elif role == "user" and user is None:
            user = content
    return system, user


class OrganicRouter:
    """Keys for unregistered prompts and chats, and the table they are learnt in."""

    def __init__(self, table: AnchorTable, spread: float = HOME_SPREAD) -> None:
        self.table = table
        self.spread = spread

    def for_chat(self, messages: Iterable[tuple[str, str]]) -> OrganicKeys:
        system, user = chat_parts(messages)
        family = chat_family(system)
        session = family if user is None else session_key(family, user)
        return OrganicKeys(family, session, self.table.count(family), -1)

    def for_prompt(self, data: bytes) -> OrganicKeys | None:
        """The prompt's keys, or None when it is shorter than one block (it then routes on
        its window key, as before)."""
        chain = _core.chain_keys(data, BLOCK_BYTES, LEARN_BLOCKS + 1)
        if not chain:
            return None
        table = self.table
        table.learn(chain, LEARN_BLOCKS)
        family = chain[0]
        anchor = table.anchor(chain[:LEARN_BLOCKS])
        if anchor < 0:
            session = family
        elif anchor + 1 < len(chain):
            session = chain[anchor + 1]
        else:
            # The prompt ends inside the block after its anchor: key its tail.
            tail = data[(anchor + 1) * BLOCK_BYTES : (anchor + 2) * BLOCK_BYTES]
            session = _core.route_key(chain[anchor].to_bytes(8, "little") + tail)
        return OrganicKeys(family, session, table.count(family), anchor)

    def homes(self, ring: _core.Ring, keys: OrganicKeys) -> int:
        """The session's pod (member index): contract 8b over the family's home set."""
        size = home_size(keys.share, len(ring.members), self.spread)
        return ring.session_home(keys.family, size, keys.session)
