"""The backend pool: membership + health + warmth -> the routing table requests pick from.

Only *serving* pods (healthy and warm) are on the ring. Dropping a pod's points sends exactly
its keys to the next pod clockwise, so sidecars that see the same pods serving agree (routing
contract v1). A joining pod is *warming* until its home prefixes are prewarmed (warm before
serve); with no pod serving (a cold start), the non-ejected pods route: a cold answer beats none.

The table is rebuilt per change and swapped by one reference, so the request path never locks.
Each pod's effective load (`Backend.load`) is mirrored into the table's `loads` with their
running total, which `Ring.pick` reads without summing (routing contract section 4): every
change moves one entry and the total by the same delta, O(1).
"""

from __future__ import annotations

import array
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefix_sidecar import _core
from prefix_sidecar.config import DEFAULTS
from prefix_sidecar.membership.prefill_queues import PrefillQueues
from prefix_sidecar.membership.sources import Member
from prefix_sidecar.routing.cost import DECODE_TOKENS, LOAD_UNITS, TOKENS, Prefill
from prefix_sidecar.routing.table import RoutingTable

logger = logging.getLogger(__name__)

# Clamp on a pod's untrusted report: at 2**20 per pod x 2**24 pods the loads' total stays far
# below the int64 limit the core refuses.
MAX_REPORTED_LOAD = 1 << 20
# Bound on the fleet view's K-estimate (sidecars' traffic a pod carries per request of ours).
MAX_FLEET_SCALE = 4096.0
# K from n of our requests is off by ~1/sqrt(n); 16 (25 %) cut cold spills at start vs 4
# (bench fleet). Below it, own counts decide.
MIN_SCALE_SAMPLE = 16  # own requests in flight on freshly read pods, summed
SCALE_STEP = 0.1  # a new estimate within 10 % of the one in use changes nothing
MAX_COMPUTED = 1024  # Backend.computed: as many prefixes as a sidecar registers by default

WARMING = "warming"
SERVING = "serving"
EJECTED = "ejected"


@dataclass
class FleetEstimate:
    """The fleet view's K-estimate, one per pool, read by every Backend's load."""

    scale: float = 1.0  # K: for a pod without a fresh reading, and our sends since one
    # Readings count only once K is estimated: a read pod (everyone's requests) beside unread
    # ones (ours only) would draw spills to cold pods.
    ready: bool = True


@dataclass
class Backend:
    url: str
    weight: int = 1
    healthy: bool | None = None  # None until the first health check decides
    warm: bool = False
    in_flight: int = 0  # this sidecar's own requests on the pod
    tokens: int = 0  # ... and what they weigh in tokens (routing/cost.py)
    counts_tokens: bool = False  # the pool's load_unit is tokens
    # ... of which the pod was chosen among 2+ pods by load (a spill or a failover), not
    # taken as the key's only home.
    chosen: int = 0
    reported_load: int | None = None  # the pod's own report (running + waiting); None: unknown
    # The fleet view: own in-flight (and chosen) when the pod's reading was taken; our
    # requests since then move the reported load (None: the report is taken as it is).
    anchor: int | None = None
    chosen_anchor: int = 0
    fleet: FleetEstimate = field(default_factory=lambda: FleetEstimate())  # the pool's, shared
    warm_prefixes: set[str] = field(default_factory=set)
    # Prefixes it computed for a request lately (oldest first, bounded): a cost hint.
    computed: dict[str, None] = field(default_factory=dict)
    last_error: str = ""

    @property
    def load(self) -> int:
        """The effective load `pick` sees: in requests (`requests`), or in tokens: own
        tokens, and each request more than our own at our mean weight (a decode term when
        we have none there)."""
        requests = self.requests
        if not self.counts_tokens:
            return requests
        own = self.in_flight
        weight = self.tokens // own if own else DECODE_TOKENS
        return self.tokens + (requests - own) * weight

    @property
    def requests(self) -> int:
        """The effective load in requests: max(own in-flight, reported or 0); in the fleet
        view max(own, reported + (own - anchor) + (chosen - chosen_anchor) x (K - 1)), or
        own x K while unread (K: the K-estimate)."""
        reported = self.reported_load
        own = self.in_flight
        scale = self.fleet.scale
        if reported is None:
            return own if scale == 1.0 else math.ceil(own * scale)
        if self.anchor is not None:
            if not self.fleet.ready:
                return own
            # Our requests since the reading, plus K - 1 others' per choice of ours: every
            # sidecar choosing on the same reading fills the same pod. Only-home requests are
            # not scaled: others send those independently of ours.
            reported += own - self.anchor + round((self.chosen - self.chosen_anchor) * (scale - 1))
        return own if reported < own else reported

    @property
    def state(self) -> str:
        if self.healthy is False:
            return EJECTED
        if self.healthy and self.warm:
            return SERVING
        return WARMING


class BackendPool:
    """Owns every Backend and rebuilds the routing table when one changes state."""

    def __init__(
        self,
        hash_table: str = DEFAULTS.hash_table,
        warm_before_serve: bool = DEFAULTS.warm_before_serve,
        load_unit: str = DEFAULTS.load_unit,
        needs_warming: Callable[[], bool] = lambda: False,
        on_warm_needed: Callable[[str], None] | None = None,
    ) -> None:
        if hash_table not in _core.HASH_TABLES:
            choices = ", ".join(_core.HASH_TABLES)
            raise ValueError(f"unknown hash table {hash_table!r}; choose one of {choices}")
        if load_unit not in LOAD_UNITS:
            raise ValueError(f"unknown load unit {load_unit!r}; choose one of {LOAD_UNITS}")
        self._hash_table = hash_table
        self._warm_before_serve = warm_before_serve
        self.load_unit = load_unit
        self._counts_tokens = load_unit == TOKENS
        self._needs_warming = needs_warming
        self._on_warm_needed = on_warm_needed
        self._watchers: list[Callable[[RoutingTable], None]] = []
        self.backends: dict[str, Backend] = {}
        self.table = RoutingTable(None, {}, array.array("q"), 0)
        self._target_ring: _core.HashTable | None = None
        self._fleet = FleetEstimate()
        self._read_reported = 0  # the fleet view's sums over the read pods: reported loads
        self._read_own = 0  # ... and own in-flight when they were read
        self.queues = PrefillQueues()  # the pods' prefill queues, as the relay fills them

    def watch(self, watcher: Callable[[RoutingTable], None]) -> None:
        """Call `watcher` with every new routing table, right after it is swapped in (and the
        target ring with it), in the order the watchers were added."""
        self._watchers.append(watcher)

    # --- inputs -------------------------------------------------------------------------

    def set_members(self, members: Sequence[Member]) -> None:
        """Adopt a new membership from the sources (already canonical and de-duplicated)."""
        wanted = {m.url: m.weight for m in members}
        for url in list(self.backends):
            if url not in wanted:
                logger.info("backend %s left the membership", url)
                self._unread(self.backends.pop(url))
        for url, weight in wanted.items():
            backend = self.backends.get(url)
            if backend is None:
                logger.info("backend %s joined the membership (weight %d)", url, weight)
                self.backends[url] = Backend(
                    url, weight, fleet=self._fleet, counts_tokens=self._counts_tokens
                )
            else:
                backend.weight = weight
        self._rebuild()
        self._rescale()

    def set_health(self, url: str, healthy: bool, reason: str | None = None) -> None:
        """Health monitor callback: ejection, admission and re-admission."""
        backend = self.backends.get(url)
        if backend is None or backend.healthy == healthy:
            return
        backend.healthy = healthy
        if not healthy:
            backend.last_error = reason or "unhealthy"
            backend.warm = False
            backend.warm_prefixes.clear()
            logger.warning("backend %s ejected: %s", url, backend.last_error)
            self._rebuild()
            return
        logger.info("backend %s is healthy", url)
        if self._warm_before_serve and self._on_warm_needed is not None and self._needs_warming():
            backend.warm = False
            self._rebuild()
            self._on_warm_needed(url)
        else:
            backend.warm = True
            self._rebuild()

    def mark_warm(self, url: str) -> None:
        """The prewarm of a warming pod finished: it joins the ring."""
        backend = self.backends.get(url)
        if backend is None:
            return
        if not backend.warm and backend.healthy:
            backend.warm = True
            logger.info("backend %s is warm and serving", url)
            self._rebuild()

    def note_warm_prefix(self, url: str, prefix_id: str) -> None:
        if (backend := self.backends.get(url)) is not None:
            backend.warm_prefixes.add(prefix_id)

    def forget_prefix(self, prefix_id: str) -> None:
        for backend in self.backends.values():
            backend.warm_prefixes.discard(prefix_id)

    # --- load accounting ----------------------------------------------------------------

    def acquire(self, url: str, chosen: bool = True, prefill: int = 0) -> None:
        """One more of our requests is in flight on `url`, with `prefill` uncached tokens
        before its first token; `chosen` False when `url` was the key's only home (the fleet
        view scales only choices by K)."""
        backend = self.backends.get(url)
        if backend is not None:
            backend.in_flight += 1
            backend.chosen += chosen
            backend.tokens += prefill + DECODE_TOKENS
            self._publish(backend)

    def prefilled(self, url: str, prefill: int, prefix_id: str = "") -> None:
        """A request on `url` had its first token: its `prefill` no longer weighs, and the
        pod holds its prefix (`prefix_id`) now."""
        backend = self.backends.get(url)
        if backend is None:
            return
        if prefix_id:
            computed = backend.computed
            computed.pop(prefix_id, None)
            computed[prefix_id] = None  # the newest last
            if len(computed) > MAX_COMPUTED:
                del computed[next(iter(computed))]
        if prefill:
            backend.tokens = max(backend.tokens - prefill, backend.in_flight * DECODE_TOKENS)
            self._publish(backend)

    def release(self, url: str, chosen: bool = True, prefill: int = 0) -> None:
        """One of this sidecar's requests on `url` ended (never below zero); `chosen` as
        it was acquired, `prefill` what of its prefill still weighed (0 after its first
        token)."""
        if (backend := self.backends.get(url)) is not None and backend.in_flight > 0:
            backend.in_flight -= 1
            if chosen and backend.chosen > 0:
                backend.chosen -= 1
            backend.tokens = max(backend.tokens - prefill - DECODE_TOKENS, 0)
            self._publish(backend)

    def prefill_on(self, prefill: Prefill, url: str) -> int:
        """A request's uncached prefill tokens on `url`: its estimate, plus its prefix's own
        on a pod not known to hold it (no home: homes are warmed before they serve)."""
        if not prefill.cold or url in prefill.homes or self.holds(url, prefill.prefix_id):
            return prefill.tokens
        return prefill.tokens + prefill.cold

    def holds(self, url: str, prefix_id: str) -> bool:
        """Whether the pod was prewarmed with the prefix or computed it for a request."""
        pod = self.backends.get(url)
        return pod is not None and (prefix_id in pod.warm_prefixes or prefix_id in pod.computed)

    def report_load(self, url: str, load: int | None) -> None:
        """The pod's reported running + queued load (response header or /metrics); None when
        unknown or stale (own in-flight then). Ignored for a non-member; clamped to
        MAX_REPORTED_LOAD (untrusted input)."""
        load = _checked_report(load)
        backend = self.backends.get(url)
        if backend is not None and backend.reported_load != load:
            backend.reported_load = load
            self._publish(backend)

    def report_reading(self, url: str, load: int | None) -> None:
        """The fleet view (docs/load-signals.md, rule 3): a fresh running + waiting reading,
        which counts every sidecar's requests; ours since move it. None (unknown or stale):
        the pod counts own in-flight x K, the read pods' reported / own ratio, so every pod's
        load is in fleet-wide units. Bounded like report_load."""
        backend = self.backends.get(url)
        if backend is None:
            return
        self._unread(backend)
        backend.reported_load = _checked_report(load)
        if backend.reported_load is not None:
            backend.anchor = backend.in_flight
            backend.chosen_anchor = backend.chosen
            self._read_reported += backend.reported_load
            self._read_own += backend.anchor
        self._publish(backend)
        self._rescale()

    def _unread(self, backend: Backend) -> None:
        """Take a pod's reading out of the K-estimate's sums."""
        if backend.anchor is not None and backend.reported_load is not None:
            self._read_reported -= backend.reported_load
            self._read_own -= backend.anchor
        backend.anchor = None

    def _rescale(self) -> None:
        """Re-estimate K from the read pods' sums (O(1)); the unread pods follow when it
        moved by more than SCALE_STEP (O(pods) then, not on a request's path)."""
        scale = 1.0
        estimated = self._read_own >= MIN_SCALE_SAMPLE
        if estimated:
            scale = min(max(self._read_reported / self._read_own, 1.0), MAX_FLEET_SCALE)
        fleet = self._fleet
        if estimated == fleet.ready and abs(scale - fleet.scale) <= SCALE_STEP * fleet.scale:
            return
        fleet.scale, fleet.ready = scale, estimated
        for backend in self.backends.values():
            self._publish(backend)

    @property
    def fleet_scale(self) -> float:
        """The fleet view's K-estimate in use (1.0 without the fleet view)."""
        return self._fleet.scale

    def _publish(self, backend: Backend) -> None:
        """Mirror the pod's effective load into the table, moving the total by the same
        delta: O(1), and sum(loads) == total holds after every call."""
        table = self.table
        index = table.index.get(backend.url)
        if index is not None:
            load = backend.load
            table.total += load - table.loads[index]
            table.loads[index] = load

    # --- outputs ------------------------------------------------------------------------

    def target_ring(self) -> _core.HashTable | None:
        """The ring over every pod that is not ejected: where prefixes *will* live once
        warming pods are warm. Prewarm targets come from here."""
        return self._target_ring

    def _rebuild(self) -> None:
        serving = [b for b in self.backends.values() if b.state == SERVING]
        alive = [b for b in self.backends.values() if b.state != EJECTED]
        ring = self._ring(serving or alive)  # no pod serving (a cold start): the warming ones
        # Serving pods are a subset of the alive ones: the same count is the same ring.
        same = not serving or len(serving) == len(alive)
        self._target_ring = ring if same else self._ring(alive)
        index = {url: i for i, url in enumerate(ring.members)} if ring is not None else {}
        loads = array.array("q", (self.backends[url].load for url in index))
        self.table = RoutingTable(ring, index, loads, self.table.generation + 1, sum(loads))
        for watcher in self._watchers:
            watcher(self.table)

    def _ring(self, backends: Sequence[Backend]) -> _core.HashTable | None:
        """The routing table over these pods: the ring, or the Maglev table (hash_table)."""
        if not backends:
            return None
        ordered = sorted(backends, key=lambda b: b.url)
        urls, weights = [b.url for b in ordered], [b.weight for b in ordered]
        # vnodes is part of routing contract section 3 (every client must agree): no setting.
        return _core.make_table(self._hash_table, urls, weights, _core.DEFAULT_VNODES)


def _checked_report(load: int | None) -> int | None:
    """A pod's report, untrusted: an int >= 0 (TypeError, ValueError), clamped to
    MAX_REPORTED_LOAD; None stays None (unknown)."""
    if load is None:
        return None
    if isinstance(load, bool) or not isinstance(load, int):
        raise TypeError(f"a reported load must be an int or None, got {type(load).__name__}")
    if load < 0:
        raise ValueError(f"a reported load must be >= 0, got {load}")
    return min(load, MAX_REPORTED_LOAD)
