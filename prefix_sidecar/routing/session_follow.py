"""Session follow: a conversation's very next request goes where this sidecar sent its
previous one (routing contract 9h).

Every sidecar computes the session's pod (9b, 9f) alike, but the previous request may have
gone elsewhere (a balanced start, a spilled turn), and its history with it. Each request
leaves a MARK and names an AFTER (a chat: its assistant-message count and one fewer; a raw
prompt: the offsets of its last two assistant headers, `chat_templates`). Only a request
whose AFTER is the mark its session's last request through this sidecar left is followed;
any other goes to the session's pod, so agreement between sidecars is unchanged.
Bounded: an LRU of `capacity` sessions (default 16,384, ~2.9 MB), O(1) per decision.
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
