"""Re-prewarm a home pod that lost a registered prefix: a KV-event sink in front of the
residency notes what each pod lost and, a debounce later (a reconnect's replay and a flood's
evictions settle first), prewarms each prefix the pod is home to, held and no longer holds.

A prewarm is a full prefill, so it is bounded: once per (prefix, pod) per
`reprewarm_interval_s` (a loss sooner is `throttled`, counted once); never where it does not
fit beside the registered prefixes the pod holds, or the pod cannot hold all it is home to,
by its peak block count (`no_room`: residency.py); held back while the pod is over its share
of our requests in flight (`busy`, for at most `reprewarm_interval_s`). All reasons:
docs/kv-events.md. A check is O(prefixes x blocks), at most once per pod per debounce.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from prefix_sidecar.kv_events.decode import AllBlocksCleared, BlockRemoved, KvEvent
from prefix_sidecar.kv_events.residency import Residency
from prefix_sidecar.prefixes import PrefixEntry, PrefixStore

logger = logging.getLogger(__name__)

REPREWARM_DEBOUNCE_S = 1.0
# reprewarm_interval_s's default: a prewarm is a full prefill (1-2 s for a few thousand tokens
# on CPU), so once per 30 s per prefix and pod is a few percent of a pod that keeps evicting.
REPREWARM_INTERVAL_S = 30.0


class ReprewarmSink:
    """A KV-event sink (subscriber.KvEventSink): feeds `residency`, then re-prewarms losses."""

    def __init__(
        self,
        residency: Residency,
        store: PrefixStore,
        home_set: Callable[[PrefixEntry], list[str]],
        warm: Callable[[PrefixEntry, str], Coroutine[Any, Any, object]],
        count: Callable[[str], None],
        warmed_on: Callable[[str], set[str]] = lambda pod: set(),
        resident: Callable[[str, int | None], None] = lambda pod, count: None,
        busy: Callable[[str], bool] = lambda pod: False,
        *,
        debounce_s: float = REPREWARM_DEBOUNCE_S,
        interval_s: float = REPREWARM_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.residency = residency
        self.store = store
        self.home_set = home_set
        self.warm = warm
        self.count = count
        self.warmed_on = warmed_on
        self.resident = resident
        self.busy = busy
        self.debounce_s = debounce_s
        self.interval_s = interval_s
        self.clock = clock
        self._had: dict[str, dict[str, bool]] = {}  # pod -> prefix -> held at the last check
        self._why: dict[str, str] = {}  # pod -> the reason of its latest possible loss
        self._checks: dict[str, asyncio.TimerHandle] = {}
        self._last: dict[tuple[str, str], float] = {}  # (pod, prefix) -> latest re-prewarm
        self._throttled: set[tuple[str, str]] = set()  # logged since its latest re-prewarm
        self._seen: dict[str, set[str]] = {}  # pod -> prefixes a check saw it hold, still held
        # (pod, prefix) -> (reason, since when) of a re-prewarm held back while the pod is busy
        self._held_back: dict[tuple[str, str], tuple[str, float]] = {}
        self.tasks: set[asyncio.Task[object]] = set()

    def reset(self, pod: str, known: bool) -> None:
        was_known = self.residency.known(pod)
        self.residency.reset(pod, known)
        if known:
            self._why[pod] = "restarted" if was_known else "unknown"
            self._schedule(pod)
        else:
            self.resident(pod, None)

    def resume(self, pod: str) -> None:
        self.residency.resume(pod)
        self._schedule(pod)  # what it is known to hold is less now: the gauge says so

    def apply(self, pod: str, events: tuple[KvEvent, ...]) -> None:
        self.residency.apply(pod, events)
        if any(isinstance(e, AllBlocksCleared) for e in events):
            self._why[pod] = "cleared"
        elif any(isinstance(e, BlockRemoved) for e in events) and self._why.get(pod) in (
            None,
            "unknown",
        ):
            self._why[pod] = "evicted"  # says more than a (re)connect in the same window
        self._schedule(pod)  # stores too: what a pod holds now is what a later loss loses

    def watch_prefix(
        self, prefix_id: str, token_ids: Sequence[int], lora_name: str | None = None
    ) -> None:
        """The prefix's token ids (often after its prewarm was stored): what each pod holds
        of it is read again, so that a later loss is seen as one."""
        self.residency.watch_prefix(prefix_id, token_ids, lora_name)
        for pod in self._had:
            self._schedule(pod)

    def forget_prefix(self, prefix_id: str) -> None:
        self.residency.forget_prefix(prefix_id)

    def keep_pods(self, urls: Iterable[str]) -> None:
        """Only `urls` are followed now: what was noted of any other pod goes (pods come and
        go under autoscaling; a departed pod's notes would otherwise stay for good)."""
        kept = set(urls)
        self.residency.keep_pods(kept)
        for pod in [p for p in self._had.keys() | self._checks.keys() if p not in kept]:
            self._had.pop(pod, None)
            self._seen.pop(pod, None)
            self._why.pop(pod, None)
            self._held_back = {k: v for k, v in self._held_back.items() if k[0] != pod}
            handle = self._checks.pop(pod, None)
            if handle is not None:
                handle.cancel()

    def stop(self) -> None:
        for handle in self._checks.values():
            handle.cancel()
        self._checks.clear()
        for task in self.tasks:
            task.cancel()

    def _schedule(self, pod: str) -> None:
        if pod not in self._checks:
            loop = asyncio.get_running_loop()
            self._checks[pod] = loop.call_later(self.debounce_s, self.check, pod)

    def check(self, pod: str) -> None:
        """Compare what `pod` holds with its last check; re-prewarm what it lost."""
        self._checks.pop(pod, None)
        reason = self._why.pop(pod, None)
        before = self._had.get(pod, {})
        # A prefix warmed there that no check has seen held since counts as held: its
        # prewarm and the flood that evicts it can both fall between two checks. Not on a pod
        # just become known: it is still replaying, so a warmed prefix not heard is not lost.
        warmed = self.warmed_on(pod) if reason != "unknown" else set()
        seen_before = self._seen.get(pod, set())
        seen: set[str] = set()  # rebuilt from the store: an unregistered prefix leaves it
        now: dict[str, bool] = {}
        lost: list[tuple[PrefixEntry, str]] = []
        holding = 0
        for entry in self.store:
            was_seen = entry.id in seen_before
            held = before.get(entry.id, False) or (entry.id in warmed and not was_seen)
            holds = self.residency.holds(pod, entry.id)
            if holds is None:
                if held:
                    now[entry.id] = True  # unknown: what it held stays the question
                if was_seen:
                    seen.add(entry.id)
                continue
            now[entry.id] = holds
            holding += holds
            back = self._held_back.get((pod, entry.id))
            if holds:
                seen.add(entry.id)  # not held now: a later prewarm of it is new again
            elif held and reason is not None:
                lost.append((entry, reason))
            elif back is not None:
                lost.append((entry, back[0]))  # held back: still lost
        self._had[pod] = now
        self._seen[pod] = seen
        self.resident(pod, holding if self.residency.known(pod) else None)
        moment = self.clock()
        self._last = {k: t for k, t in self._last.items() if moment - t < self.interval_s}
        self._throttled &= self._last.keys()
        homes = [(entry, why) for entry, why in lost if pod in self.home_set(entry)]
        ids = {entry.id for entry, _ in homes}  # what is held back of the pod is among them
        self._held_back = {k: v for k, v in self._held_back.items() if k[0] != pod or k[1] in ids}
        kept = [prefix_id for prefix_id, holds in now.items() if holds] if homes else []
        # every prefix the pod is home to: when they cannot all fit, a refill evicts another
        home_to = [e.id for e in self.store if pod in self.home_set(e)] if homes else []
        homes_fit = self._can_hold(pod, home_to)
        busy = bool(homes) and self.busy(pod)
        for entry, why in homes:
            if (pod, entry.id) in self._last:
                if (pod, entry.id) in self._throttled:
                    continue  # said once per interval: a thrashing pod loses it every check
                self._throttled.add((pod, entry.id))
                self.count("throttled")
                logger.warning(
                    "%s lost prefix %s again within %.0f s: not re-prewarmed (too small "
                    "for the prefixes it is home to?)",
                    pod,
                    entry.id,
                    self.interval_s,
                )
                continue
            if busy and self._hold_back(pod, entry.id, why, moment):
                continue
            self._held_back.pop((pod, entry.id), None)
            self._last[(pod, entry.id)] = moment
            if not homes_fit or not self._fits(pod, kept, entry.id):
                self._throttled.add((pod, entry.id))  # said: once per interval, as above
                self.count("no_room")
                logger.warning(
                    "%s lost prefix %s and holds other registered prefixes that leave no room "
                    "for it (~%d blocks at most): not re-prewarmed, its traffic rebuilds it; "
                    "the pod is too small for the prefixes sent to it",
                    pod,
                    entry.id,
                    self.residency.capacity(pod),
                )
                continue
            self.count(why)
            logger.info("re-prewarming prefix %s on %s (%s)", entry.id, pod, why)
            task = asyncio.get_running_loop().create_task(self.warm(entry, pod))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        if any(key[0] == pod for key in self._held_back):
            self._schedule(pod)  # looked at again: the pod may be back to its share

    def _hold_back(self, pod: str, prefix_id: str, why: str, moment: float) -> bool:
        """Whether the re-prewarm of `prefix_id` on busy `pod` waits (counted `busy` once);
        not once it has waited `interval_s`: a pod always busy is refilled all the same."""
        since = self._held_back.get((pod, prefix_id), (why, moment))[1]
        if moment - since >= self.interval_s:
            return False
        if (pod, prefix_id) not in self._held_back:
            self.count("busy")
            logger.info("re-prewarm of prefix %s on %s held back: the pod is busy", prefix_id, pod)
        self._held_back[(pod, prefix_id)] = (why, since)
        return True

    def _can_hold(self, pod: str, prefix_ids: list[str]) -> bool:
        """Whether `pod` can hold all these prefixes at once, by the most blocks it was heard
        to hold (a pod that has not filled yet has room)."""
        capacity = self.residency.capacity(pod)
        return not capacity or self.residency.footprint(pod, prefix_ids) <= capacity

    def _fits(self, pod: str, kept: list[str], prefix_id: str) -> bool:
        """Whether `prefix_id` fits on `pod` beside `kept`, the registered prefixes it holds
        (then it joins them); the caller has checked the pod can hold all it is home to. A
        prewarm that does not fit evicts a registered prefix still serving, which is then
        lost and prewarmed in turn: a prefill storm on pods already short of KV."""
        if not self._can_hold(pod, [*kept, prefix_id]):
            return False
        kept.append(prefix_id)
        return True
