"""What a pod's readings mean for the load the pick sees (docs/load-signals.md's rules).

A sidecar sees only its own requests; the pods see everyone's. `LoadSignals` keeps one
timestamped record per pod and feeds the pool one rule: the fleet view (rule 3, default)
passes each fresh running + waiting reading (the pool adds our requests since, choices x K);
the saturation report (rule 2) puts a queueing or KV-full pod over its bounded-load cap.
A reading older than `MAX_AGE_S` is None: own in-flight counts decide (x K in the fleet view).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prefix_sidecar.membership.load_signals.parse import PodReport, parse_load_header

# A: seconds a reading counts (docs/load-signals.md section 2); four poll intervals, and a pod
# unheard for A / 2 is polled again before its reading ages out.
MAX_AGE_S = 2.0
# KV usage at or above this counts as saturated (rule 2): vLLM preempts near a full cache.
KV_THRESHOLD = 0.95
# Rule 3: 8 sidecars keep a 1.0000 hit rate with it, not without (docs/benchmarks.md "The
# fleet view").
FLEET_VIEW = True
# Rule 2: harmful at 2x rate with 4 sidecars (docs/benchmarks.md "Pod load signals"). When on
# it replaces rule 3; it reports loads in requests, so it suits load_unit requests.
REPORT_SATURATION = False


@dataclass(frozen=True)
class LoadRule:
    """When a pod's readings say it is saturated (the routing contract text is in
    docs/load-signals.md)."""

    max_age_s: float = MAX_AGE_S  # older readings are unknown
    kv_threshold: float = KV_THRESHOLD  # KV usage at or above this: saturated

    def queues(self, pod: PodState, now: float) -> bool:
        """True when a fresh reading says requests wait on the pod (waiting > 0)."""
        return pod.waiting_at >= now - self.max_age_s and (pod.waiting or 0.0) > 0.0

    def saturated(self, pod: PodState, now: float) -> bool | None:
        """True when a fresh reading says the pod queues (waiting > 0) or its KV is full;
        None when no reading of either is younger than max_age_s."""
        fresh = now - self.max_age_s
        waiting = pod.waiting if pod.waiting_at >= fresh else None
        kv = pod.kv_usage if pod.kv_at >= fresh else None
        if waiting is None and kv is None:
            return None
        return (waiting or 0.0) > 0.0 or (kv is not None and kv >= self.kv_threshold)


@dataclass
class PodState:
    """The freshest reading of each quantity, with the monotonic time it was taken."""

    running: float | None = None
    running_at: float = -math.inf
    waiting: float | None = None
    waiting_at: float = -math.inf
    kv_usage: float | None = None
    kv_at: float = -math.inf
    kv_tokens: int | None = None  # the pod's KV size; configuration, it does not age
    heard_at: float = -math.inf  # the last reading of any kind
    asked_at: float = -math.inf  # the last /metrics poll sent, answered or not
    sent_at: float = -math.inf  # the last request this sidecar sent it
    pushed: int | None = None  # the last load given to the pool
    read: bool = False  # the fleet view: a reading of the pod's load is in the pool

    def take(self, report: PodReport, now: float) -> None:
        if report.running is not None:
            self.running, self.running_at = report.running, now
        if report.waiting is not None:
            self.waiting, self.waiting_at = report.waiting, now
        if report.kv_usage is not None:
            self.kv_usage, self.kv_at = report.kv_usage, now
        if report.kv_tokens is not None:
            self.kv_tokens = report.kv_tokens
        self.heard_at = now


class LoadSignals:
    """Per-pod readings -> `on_load(url, load | None)` when a pod's reported load changes,
    and KV sizes -> `on_kv(tokens | None)` when the agreed size changes.

    A saturated pod is reported at `over_cap(url)`, a load over its bounded-load cap, so every
    sidecar spills past it while it queues; others are reported None (own in-flight decides).
    Without `over_cap` nothing is reported (readings are still kept)."""

    def __init__(
        self,
        on_load: Callable[[str, int | None], None],
        rule: LoadRule | None = None,
        *,
        over_cap: Callable[[str], int | None] | None = None,
        on_reading: Callable[[str, int | None], None] | None = None,
        on_kv: Callable[[int | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_reading` is the fleet view (rule 3): each fresh reading of a pod's running +
        waiting, as it arrives, and None once it is stale."""
        self.rule = rule or LoadRule()
        self._on_load = on_load
        self._over_cap = over_cap
        self._on_reading = on_reading
        self._on_kv = on_kv
        self._clock = clock
        self.pods: dict[str, PodState] = {}
        self.kv_tokens: int | None = None
        self.headers_seen = 0
        self.headers_refused = 0
        self.all_saturated = False  # every member saturated: nothing is reported

    def set_members(self, urls: Iterable[str]) -> None:
        """Follow the membership: new pods start unknown, gone ones are forgotten."""
        wanted = set(urls)
        for url in list(self.pods):
            if url not in wanted:
                del self.pods[url]
        for url in wanted:
            self.pods.setdefault(url, PodState())
        self._agree_kv()

    def note_sent(self, url: str) -> None:
        pod = self.pods.get(url)
        if pod is not None:
            pod.sent_at = self._clock()

    def observe_header(self, url: str, value: str | None) -> None:
        """A response's `endpoint-load-metrics` header (None when the pod sent none)."""
        if value is None:
            return
        report = parse_load_header(value)
        if report is None:
            self.headers_refused += 1
            return
        self.headers_seen += 1
        self.observe(url, report)

    def observe(self, url: str, report: PodReport) -> None:
        pod = self.pods.get(url)
        if pod is None:
            return  # not (or no longer) a member: a late answer from a pod that left
        kv_before = pod.kv_tokens
        now = self._clock()
        pod.take(report, now)
        changed = self._check_all_saturated(now)
        if self._on_reading is not None:
            if changed:
                self._read_all(now)
            elif report.running is not None and not self.all_saturated:
                # Only a reading that counts the running requests is a load; a header
                # (waiting and KV only) adds to the last one while it is fresh.
                pod.read = True
                self._on_reading(url, _fleet_load(pod, now - self.rule.max_age_s))
        if changed:
            self._push_all(now)
        else:
            self._push(url, pod, now)
        if pod.kv_tokens != kv_before:
            self._agree_kv()

    def expire(self) -> None:
        """Give the pool None for every pod whose readings aged out since the last push."""
        now = self._clock()
        changed = self._check_all_saturated(now)
        self._push_all(now)
        if self._on_reading is not None:
            if changed:
                self._read_all(now)
            fresh = now - self.rule.max_age_s
            for url, pod in self.pods.items():
                if pod.read and pod.running_at < fresh:
                    pod.read = False
                    self._on_reading(url, None)

    def _read_all(self, now: float) -> None:
        """Re-send the fleet view when all-saturated flips: while every pod is saturated no
        reading is used (see `_check_all_saturated`); after, the fresh ones."""
        assert self._on_reading is not None
        fresh = now - self.rule.max_age_s
        for url, pod in self.pods.items():
            load = None if self.all_saturated else _fleet_load(pod, fresh)
            if load is not None or pod.read:
                pod.read = load is not None
                self._on_reading(url, load)

    def saturated(self, url: str) -> bool | None:
        pod = self.pods.get(url)
        return None if pod is None else self.rule.saturated(pod, self._clock())

    def now(self) -> float:
        return self._clock()

    def stale(self, refresh_after_s: float) -> list[str]:
        """Pods not heard from for refresh_after_s: what the poller may ask. The fleet view
        needs the running count, which only /metrics says."""
        limit = self._clock() - refresh_after_s
        fleet = self._on_reading is not None
        return [
            url
            for url, pod in self.pods.items()
            if max(pod.running_at if fleet else pod.heard_at, pod.asked_at) < limit
        ]

    def _check_all_saturated(self, now: float) -> bool:
        """Whether every member is saturated now; True when that changed. Then no pod is
        reported: with all over their caps, readings up to an interval old would send every
        sidecar to the same least-loaded pod; own live counts spread the overload better."""
        # The fleet view tests queueing only: KV near full is by design under a home budget
        # (bench fleet: counting it caused spills).
        test = self.rule.queues if self._on_reading is not None else self.rule.saturated
        every = bool(self.pods) and all(test(pod, now) for pod in self.pods.values())
        changed = every != self.all_saturated
        self.all_saturated = every
        return changed

    def _push_all(self, now: float) -> None:
        for url, pod in self.pods.items():
            self._push(url, pod, now)

    def _push(self, url: str, pod: PodState, now: float) -> None:
        over_cap = self._over_cap
        saturated = self.rule.saturated(pod, now) and not self.all_saturated
        load = over_cap(url) if saturated and over_cap is not None else None
        if load != pod.pushed:
            pod.pushed = load
            self._on_load(url, load)

    def _agree_kv(self) -> None:
        """Every sidecar that knows the same pods' sizes agrees: the smallest known size
        (a prefix placed within it fits on whichever pod it lands); None while none is
        known (the config's budget, or the plain ring, decides)."""
        sizes = [pod.kv_tokens for pod in self.pods.values() if pod.kv_tokens is not None]
        agreed = min(sizes) if sizes else None
        if agreed != self.kv_tokens:
            self.kv_tokens = agreed
            if self._on_kv is not None:
                self._on_kv(agreed)


def _fleet_load(pod: PodState, fresh: float) -> int | None:
    """running + waiting (waiting 0 when not read since `fresh`), rounded; None unread."""
    if pod.running is None or pod.running_at < fresh:
        return None
    waiting = pod.waiting if pod.waiting is not None and pod.waiting_at >= fresh else 0.0
    return round(pod.running + waiting)
