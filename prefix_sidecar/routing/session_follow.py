"""Session follow: a conversation's next request goes where this sidecar sent its previous
one (routing contract 9h).

The session's pod (9b, 9f) is what every sidecar computes alike without talking. A sidecar
that sent a conversation's previous request knows better where its history is now: the
conversation's start may have gone to a less-loaded pod of its home set (9f), or bounded
load may have spilled a turn. When the same sidecar gets the very next request of that
conversation - the request right after the one it remembers, so no other sidecar sent
one in between - it sends it where the previous one went, and the
request finds its whole history there. Any other request goes to the session's pod, as
every sidecar would send it: the agreement between sidecars is unchanged, a sidecar only
uses what it saw itself.

What tells the very next request is a MARK each request leaves and the AFTER each names:
a chat leaves its number of assistant messages and names one fewer; a raw prompt in a
known chat template leaves the offset of its last assistant header and names the offset of
the one before it (`chat_templates`). A request whose AFTER is the mark the session's last
request through this sidecar left is that request's very next one. A raw prompt of no
known template has neither, and keeps the session's pod. Bounded: an LRU of `capacity`
conversations (default 16,384: about 2.9 MB measured), O(1) per decision.
"""

from __future__ import annotations

from collections import OrderedDict

CAPACITY = 16_384
NO_MARK = -2  # a request that leaves no mark, or names none: never followed


class SessionFollow:
    """The pod this sidecar sent each recent conversation's last request to."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity is {capacity}; it must be >= 1")
        self.capacity = capacity
        # session key -> (backend, the mark its last request left)
        self._last: OrderedDict[int, tuple[str, int]] = OrderedDict()

    def recall(self, session: int, after: int) -> str | None:
        """Where the conversation's previous request went, if this sidecar sent it: the
        remembered request left the mark `after` names. None otherwise."""
        entry = self._last.get(session)
        if entry is None or entry[1] != after or after == NO_MARK:
            return None
        return entry[0]

    def remember(self, session: int, backend: str, mark: int) -> None:
        last = self._last
        last[session] = (backend, mark)
        last.move_to_end(session)
        if len(last) > self.capacity:
            last.popitem(last=False)

    def __len__(self) -> int:
        return len(self._last)
