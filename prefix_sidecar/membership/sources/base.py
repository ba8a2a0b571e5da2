"""The membership source interface, the watch loop all sources share, and their union.

The loop (`_poll_sources`) polls each source on its own interval and reports only changes.
An error, a garbage file or an empty DNS answer is logged and the source's last good answer
kept: dropping every backend over a half-written ConfigMap or a DNS hiccup makes an outage.
"""

from __future__ import annotations

import asyncio
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prefix_sidecar.membership.sources.members import Member, MembershipError, sorted_members

logger = logging.getLogger(__name__)

UpdateCallback = Callable[[list[Member]], None]


class MembershipSource(ABC):
    """A place backends come from. `interval_s` is how often `watch` re-resolves it."""

    interval_s: float = math.inf

    @property
    @abstractmethod
    def description(self) -> str:
        """Short text naming the source in logs and errors."""

    @abstractmethod
    async def resolve(self) -> list[Member]:
        """Resolve once, sorted by url; raise MembershipError with a clear message on failure."""

    async def watch(self, on_update: UpdateCallback) -> None:
        """Call on_update with each new non-empty membership; run until cancelled."""
        await _poll_sources([self], on_update)


class CombinedSource(MembershipSource):
    """The union of several sources (e.g. static + file + DNS), de-duplicated by url.

    When two sources list the same url with different weights, the first source wins.
    """

    def __init__(self, sources: Sequence[MembershipSource]) -> None:
        if not sources:
            raise ValueError("combined source needs at least one source")
        self.sources = list(sources)
        self.interval_s = min(s.interval_s for s in self.sources)

    @property
    def description(self) -> str:
        return " + ".join(s.description for s in self.sources)

    async def resolve(self) -> list[Member]:
        results = await asyncio.gather(*(s.resolve() for s in self.sources), return_exceptions=True)
        pairs = list(zip(self.sources, results, strict=True))
        errors = [f"{s.description}: {r}" for s, r in pairs if _failed(r)]
        if errors:
            raise MembershipError("; ".join(errors))
        return _union([r for r in results if isinstance(r, list)])

    async def watch(self, on_update: UpdateCallback) -> None:
        await _poll_sources(self.sources, on_update)


def _failed(result: object) -> bool:
    if isinstance(result, BaseException) and not isinstance(result, Exception):
        raise result  # cancellation, KeyboardInterrupt: not ours to swallow
    return isinstance(result, Exception)


def _union(member_lists: Iterable[list[Member]]) -> list[Member]:
    by_url: dict[str, Member] = {}
    for members in member_lists:
        for member in members:
            by_url.setdefault(member.url, member)
    return sorted_members(by_url.values())


@dataclass
class _SourceState:
    source: MembershipSource
    next_due: float = 0.0
    last_good: list[Member] = field(default_factory=list)
    error: str | None = None
    error_logged_at: float = -math.inf


ERROR_RELOG_S = 60.0  # a persisting error is repeated this often, not every poll


async def _poll_sources(sources: Sequence[MembershipSource], on_update: UpdateCallback) -> None:
    loop = asyncio.get_running_loop()
    states = [_SourceState(s) for s in sources]
    reported: list[Member] | None = None
    while True:
        started = loop.time()
        due = [st for st in states if st.next_due <= started]
        if due:
            results = await asyncio.gather(
                *(st.source.resolve() for st in due), return_exceptions=True
            )
            for st, result in zip(due, results, strict=True):
                st.next_due = started + st.source.interval_s
                _absorb(st, result, loop.time())
            merged = _union(st.last_good for st in states)
            if merged and merged != reported:
                try:
                    on_update(list(merged))
                    reported = merged
                except Exception:
                    logger.exception("membership update callback failed; will retry")
        next_due = min(st.next_due for st in states)
        if math.isinf(next_due):
            await loop.create_future()  # only static sources: nothing will ever change
        else:
            await asyncio.sleep(max(0.0, next_due - loop.time()))


def _absorb(st: _SourceState, result: list[Member] | BaseException, now: float) -> None:
    """Take one resolve result: keep it if good, else log why and keep the last good."""
    if _failed(result):
        error = str(result) if isinstance(result, MembershipError) else repr(result)
    elif not result:
        error = f"{st.source.description} returned no backends"
    else:
        assert isinstance(result, list)
        if st.error is not None:
            logger.info(
                "membership source %s recovered: %d backends", st.source.description, len(result)
            )
        st.error = None
        st.last_good = sorted_members(result)
        return
    if error != st.error or now - st.error_logged_at >= ERROR_RELOG_S:
        kept = f"{len(st.last_good)} backends" if st.last_good else "none yet"
        logger.error(
            "membership source %s: %s; keeping the last good membership (%s)",
            st.source.description,
            error,
            kept,
        )
        st.error_logged_at = now
    st.error = error
