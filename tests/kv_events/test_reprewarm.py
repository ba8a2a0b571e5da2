"""Re-prewarm on a loss (kv_events/reprewarm.py): a home pod that held a registered prefix and
lost it is prewarmed once the debounce has passed, at most once per interval, with the reason
counted; a reset followed by its replayed history is no loss. A real Residency and store,
events as vLLM sends them, the prewarm a recorder."""

from __future__ import annotations

import asyncio

from prefix_sidecar.kv_events.decode import AllBlocksCleared, BlockRemoved
from prefix_sidecar.kv_events.follow import over_share
from prefix_sidecar.kv_events.reprewarm import ReprewarmSink
from prefix_sidecar.kv_events.residency import Residency
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.membership.sources import Member
from prefix_sidecar.prefixes import PrefixEntry, PrefixStore

from .test_residency import PREFIX, stored_chunks

DEBOUNCE_S = 0.02
INTERVAL_S = 30.0


OTHER = [t + 1000 for t in range(13)]  # a second prefix of 3 whole blocks, none shared


class Setup:
    def __init__(self, homes: tuple[str, ...] = ("a", "b"), warmed_on: str = "") -> None:
        self.store = PrefixStore()
        self.entry = self.store.register("p", "the prefix's text")[0]
        self.residency = Residency()
        self.residency.watch_prefix(self.entry.id, PREFIX)
        self.other: PrefixEntry | None = None
        self.warmed: list[tuple[str, str]] = []
        self.counted: list[str] = []
        self.now = 0.0
        self.resident: dict[str, int | None] = {}
        self.warmed_on: dict[str, set[str]] = {warmed_on: {self.entry.id}} if warmed_on else {}
        self.busy: set[str] = set()  # pods over their share of this sidecar's requests
        self.sink = ReprewarmSink(
            self.residency,
            self.store,
            lambda _entry: list(homes),
            self.warm,
            self.counted.append,
            lambda pod: self.warmed_on.get(pod, set()),
            self.resident.__setitem__,
            self.busy.__contains__,
            debounce_s=DEBOUNCE_S,
            interval_s=INTERVAL_S,
            clock=lambda: self.now,
        )

    def register_other(self) -> PrefixEntry:
        self.other = self.store.register("q", "another prefix's text")[0]
        self.sink.watch_prefix(self.other.id, OTHER)
        return self.other

    async def warm(self, entry: PrefixEntry, pod: str) -> None:
        self.warmed.append((entry.id, pod))

    def store_prefix(self, pod: str) -> None:
        self.sink.apply(pod, tuple(stored_chunks(PREFIX, 50)))

    def evict(self, pod: str) -> None:
        self.sink.apply(pod, (BlockRemoved((50,)),))

    async def lost_at(self, moment: float, stored_again: bool = True) -> None:
        """At `moment`, pod a (stored the prefix again, then) lost it; checked."""
        self.now = moment
        if stored_again:
            self.store_prefix("a")
            await self.settle()
        self.evict("a")
        await self.settle()

    async def settle(self) -> None:
        await asyncio.sleep(DEBOUNCE_S * 3)


async def held_then(setup: Setup, pod: str = "a") -> None:
    setup.sink.reset(pod, known=True)
    setup.store_prefix(pod)
    await setup.settle()
    assert setup.residency.holds(pod, setup.entry.id) is True


async def test_an_evicted_home_is_prewarmed_once_per_interval_and_throttled_between() -> None:
    setup = Setup()
    await held_then(setup)
    setup.evict("a")
    await setup.settle()
    assert setup.warmed == [(setup.entry.id, "a")] and setup.counted == ["evicted"]

    # Prewarmed again (its blocks stored), lost again 10 s later: not sent, counted.
    await setup.lost_at(10.0)
    assert len(setup.warmed) == 1 and setup.counted == ["evicted", "throttled"]

    # Once the interval has passed, it is sent again.
    await setup.lost_at(10.0 + INTERVAL_S)
    assert len(setup.warmed) == 2 and setup.counted == ["evicted", "throttled", "evicted"]


async def test_a_reset_followed_by_its_replayed_history_is_no_loss() -> None:
    setup = Setup()
    await held_then(setup)
    setup.sink.reset("a", known=True)  # a reconnect: the history comes back at once
    setup.store_prefix("a")
    await setup.settle()
    assert setup.warmed == [] and setup.counted == []


async def test_each_way_of_losing_it_has_its_reason() -> None:
    setup = Setup(homes=("a", "b", "c"))
    for pod in ("a", "b", "c"):
        await held_then(setup, pod)
    setup.sink.apply("a", (AllBlocksCleared(),))
    setup.sink.reset("b", known=True)  # its sequence restarted: an empty cache
    setup.sink.reset("c", known=False)  # its publisher went away
    await setup.settle()
    assert sorted(setup.counted) == ["cleared", "restarted"]
    setup.sink.reset("c", known=True)  # back, without the prefix
    await setup.settle()
    assert sorted(setup.counted) == ["cleared", "restarted", "unknown"]
    assert sorted(pod for _, pod in setup.warmed) == ["a", "b", "c"]


async def test_a_pod_that_is_no_home_is_not_prewarmed() -> None:
    setup = Setup(homes=("b",))
    await held_then(setup)
    setup.evict("a")
    await setup.settle()
    assert setup.warmed == [] and setup.counted == []


async def test_a_prefix_whose_token_ids_came_after_its_blocks_is_still_followed() -> None:
    """The prewarm is often stored before /tokenize answered: its arrival is a new look."""
    setup = Setup()
    setup.residency.forget_prefix(setup.entry.id)
    setup.sink.reset("a", known=True)
    setup.store_prefix("a")
    await setup.settle()
    setup.sink.watch_prefix(setup.entry.id, PREFIX)
    await setup.settle()
    setup.evict("a")
    await setup.settle()
    assert setup.warmed == [(setup.entry.id, "a")] and setup.counted == ["evicted"]


async def test_a_prewarm_evicted_within_one_debounce_is_a_loss() -> None:
    # Seen on real vLLM: the prewarm's blocks and the flood that evicts them in one window,
    # so no check ever saw the prefix held; that the sidecar warmed it there says it was.
    setup = Setup(warmed_on="a")
    setup.sink.reset("a", known=True)
    setup.store_prefix("a")
    setup.evict("a")
    await setup.settle()
    assert setup.warmed == [(setup.entry.id, "a")]
    assert setup.counted == ["evicted"]


async def test_a_prewarm_evicted_after_a_check_that_came_before_it_is_a_loss() -> None:
    # Seen on real vLLM: the pod's first check ran before its prewarm landed (not held),
    # then the prewarm's blocks and the flood that evicted them fell before the next check.
    setup = Setup()
    setup.sink.reset("a", known=True)
    await setup.settle()
    assert setup.resident == {"a": 0}
    setup.warmed_on["a"] = {setup.entry.id}
    setup.store_prefix("a")
    setup.evict("a")
    await setup.settle()
    assert setup.warmed == [(setup.entry.id, "a")] and setup.counted == ["evicted"]


async def test_a_prewarm_not_yet_replayed_by_a_pod_just_followed_is_no_loss() -> None:
    # Seen in CI: the sidecar subscribes to a prefix's homes as it registers it; the check
    # after the first connect came before the replay brought the prewarm's blocks.
    setup = Setup(warmed_on="a")
    setup.sink.reset("a", known=True)  # the first connect: the pod was not known
    await setup.settle()
    assert setup.warmed == [] and setup.counted == []
    setup.store_prefix("a")  # the replay arrives
    setup.evict("a")  # then the flood: a loss
    await setup.settle()
    assert setup.warmed == [(setup.entry.id, "a")] and setup.counted == ["evicted"]


async def test_a_home_still_without_it_after_the_interval_is_prewarmed_again() -> None:
    setup = Setup(warmed_on="a")
    await held_then(setup)
    setup.evict("a")
    await setup.settle()
    for second in (1.0, 2.0, 3.0):  # a thrashing pod: every check another loss event
        await setup.lost_at(second, stored_again=False)
    assert len(setup.warmed) == 1 and setup.counted == ["evicted", "throttled"]
    await setup.lost_at(INTERVAL_S + 1.0, stored_again=False)
    assert len(setup.warmed) == 2 and setup.counted == ["evicted", "throttled", "evicted"]


async def test_each_check_says_how_many_prefixes_the_pod_holds() -> None:
    setup = Setup()
    await held_then(setup)
    assert setup.resident == {"a": 1}
    setup.evict("a")
    await setup.settle()
    assert setup.resident == {"a": 0}
    setup.sink.reset("a", known=False)  # unknown at once: no figure, not a zero
    assert setup.resident == {"a": None}


async def test_what_it_notes_is_bounded_by_the_store_and_the_followed_pods() -> None:
    # Registration churn and pod churn: an unregistered prefix and a departed pod leave
    # its notes, which would otherwise grow for as long as the sidecar runs.
    setup = Setup(warmed_on="a")
    await held_then(setup, "a")
    await held_then(setup, "b")
    assert setup.sink._seen == {"a": {setup.entry.id}, "b": {setup.entry.id}}
    setup.store.unregister_id(setup.entry.id)
    setup.store_prefix("a")  # any event: the pod is checked again
    await setup.settle()
    assert setup.sink._seen["a"] == set() and setup.sink._had["a"] == {}
    setup.sink.keep_pods(["a"])
    assert setup.sink._had.keys() == {"a"} and setup.sink._seen.keys() == {"a"}


async def test_a_pod_too_small_for_its_homes_is_not_refilled_with_what_evicts_another() -> None:
    # Pod a (3 blocks) is home to p (2 blocks) and q (3): q's traffic evicted p. Prewarming
    # p again would evict q, which would be lost and prewarmed in turn, and so on (seen on
    # 2 real vLLM pods short of KV: TTFT p99 2-3x that of kv_events off).
    setup = Setup(homes=("a",))
    setup.register_other()
    await held_then(setup)
    setup.sink.apply("a", (BlockRemoved((50, 51)), *stored_chunks(OTHER, 60)))
    await setup.settle()
    assert setup.residency.capacity("a") == 3 and setup.resident == {"a": 1}
    assert setup.warmed == [] and setup.counted == ["no_room"]
    # Other traffic evicted q too: q alone would fit, but p's traffic or prewarm would
    # evict it again within seconds, and requests would wait behind its prefill (2 real
    # vLLM pods, the mega-sale: one run in four had its first requests wait 1.3-4.1 s
    # behind two such refills). Neither is refilled; their traffic rebuilds them.
    setup.sink.apply("a", (BlockRemoved((60, 61, 62)), *stored_chunks(list(range(12)), 80)))
    await setup.settle()
    assert setup.resident == {"a": 0}
    assert setup.warmed == [] and setup.counted == ["no_room", "no_room"]


async def test_a_prewarm_never_evicts_a_registered_prefix_the_pod_serves_for_another_home() -> None:
    # q's home is b, but the bounded load spilled its traffic to a, which holds it now: a
    # prewarm of p would evict it as surely as a home's (seen on 2 real vLLM pods: the
    # pods pushed each other's prefixes out for the first seconds of the mega-sale).
    setup = Setup(homes=("a",))
    other = setup.register_other()
    setup.sink.home_set = lambda entry: ["a"] if entry.id == setup.entry.id else ["b"]
    await held_then(setup)
    setup.sink.apply("a", (BlockRemoved((50, 51)), *stored_chunks(OTHER, 60)))
    await setup.settle()
    assert setup.residency.holds("a", other.id) is True
    assert setup.warmed == [] and setup.counted == ["no_room"]


async def lost_while_busy() -> Setup:
    """Pod a held the prefix and lost it while over its share of requests."""
    setup = Setup()
    await held_then(setup)
    setup.busy.add("a")
    setup.evict("a")
    await setup.settle()
    return setup


async def test_a_busy_pods_re_prewarm_waits_until_it_is_back_to_its_share() -> None:
    # A re-prewarm is the whole prefix's prefill: on a busy pod its requests wait behind it
    # (2 real vLLM pods, the mega-sale: the first requests 3-4 s slow behind one).
    setup = await lost_while_busy()
    assert setup.warmed == [] and setup.counted == ["busy"]
    setup.now = 5.0
    await setup.settle()  # looked at each debounce, counted once
    assert setup.warmed == [] and setup.counted == ["busy"]
    setup.busy.clear()
    await setup.settle()
    assert setup.warmed == [(setup.entry.id, "a")] and setup.counted == ["busy", "evicted"]
    await setup.settle()
    assert len(setup.warmed) == 1 and not setup.sink._held_back


async def test_a_pod_busy_for_a_whole_interval_is_prewarmed_all_the_same() -> None:
    setup = await lost_while_busy()
    setup.now = INTERVAL_S
    await setup.settle()
    assert setup.warmed == [(setup.entry.id, "a")] and setup.counted == ["busy", "evicted"]


async def test_what_a_busy_pod_rebuilt_itself_or_is_no_longer_home_to_is_not_held_back() -> None:
    setup = await lost_while_busy()
    setup.store_prefix("a")  # its own traffic computed it again
    await setup.settle()
    assert not setup.sink._held_back and "a" not in setup.sink._checks
    setup.evict("a")
    await setup.settle()
    assert setup.sink._held_back
    setup.sink.home_set = lambda entry: ["b"]  # the ring moved: a is no longer its home
    setup.busy.clear()
    await setup.settle()
    assert setup.warmed == [] and not setup.sink._held_back


def test_a_pod_is_busy_above_the_healthy_pods_mean() -> None:
    a, b, c = (f"http://10.0.0.{n}:8000" for n in (1, 2, 3))
    pool = BackendPool()
    pool.set_members([Member(url) for url in (a, b, c)])
    for url, in_flight in ((a, 3), (b, 1), (c, 9)):
        pool.set_health(url, True)
        pool.backends[url].in_flight = in_flight
    pool.set_health(c, False)  # an ejected pod is no share
    assert [over_share(pool, url) for url in (a, b, "http://gone:8000")] == [True, False, False]
    pool.backends[a].in_flight = 1
    assert not over_share(pool, a)  # all at the mean: none is busy
