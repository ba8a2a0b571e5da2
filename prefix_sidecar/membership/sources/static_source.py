"""Backends given on the command line or in code: a list that never changes."""

from __future__ import annotations

from collections.abc import Sequence

from prefix_sidecar.membership.sources.base import MembershipSource
from prefix_sidecar.membership.sources.members import (
    ALLOW_FIELD,
    Member,
    admit,
    sorted_members,
)


class StaticSource(MembershipSource):
    """Backends given on the command line or in code; never changes."""

    def __init__(self, members: Sequence[Member | str], allow_special: bool = False) -> None:
        parsed = [m if isinstance(m, Member) else Member(m) for m in members]
        if not parsed:
            raise ValueError("static backend list is empty; give at least one backend URL")
        urls = [m.url for m in parsed]
        duplicates = sorted({u for u in urls if urls.count(u) > 1})
        if duplicates:
            raise ValueError(f"static backend list repeats {duplicates}; list each once")
        kept = admit(((m, f"backend {m.url}") for m in parsed), "static list", allow_special, set())
        if not kept:
            raise ValueError(
                f"every static backend was refused ({', '.join(urls)}): none can be a pod; "
                f"set {ALLOW_FIELD} to accept them"
            )
        self._members = sorted_members(kept)

    @property
    def description(self) -> str:
        return f"static list ({len(self._members)} backends)"

    async def resolve(self) -> list[Member]:
        return list(self._members)
