"""Per pod, a ZMQ SUB socket on vLLM's KV events (found by `GET /kv_event_sources`), each
batch's sequence number checked against the one expected. The sink hears, in order:
- `reset(pod, known=True)` then the history from 0 off the pod's replay ROUTER on connect; on
  a first batch without that, or a restart (seq backwards), the same if the pod still holds
  batch 0, else `resume` (a pod past vLLM's 10,000-batch buffer is never replayable);
- on a gap, the batches replayed (at most once per REPLAY_INTERVAL_S), else `resume`; on a
  batch that does not decode, `resume`; after QUIET_S idle, any batch past the last replayed;
- `reset(pod, known=False)` at once when the publisher goes away; `apply` for the rest.
Bounded: zmq queues at most RCVHWM batches and drops a peer whose frame is over the decoder's
cap unread; a task yields every STEP_MESSAGES batches or STEP_SECONDS, so a flood costs that
pod's events (seen as gaps), never a loop stall. The full table: docs/kv-events.md.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.asyncio

from prefix_sidecar.kv_events.decode import (
    MAX_PAYLOAD_BYTES,
    DecodeError,
    EventBatch,
    KvEvent,
    decode_message,
    decode_seq,
)
from prefix_sidecar.kv_events.sources import (
    SOURCES_MAX_BYTES,
    SOURCES_PATH,
    SOURCES_TIMEOUT_S,
    Source,
    SourceError,
    parse_sources,
)
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError

logger = logging.getLogger(__name__)

RETRY_S = 2.0  # x U(0.5, 1.5): a pod without events is asked again
RCVHWM = 10_000
STEP_MESSAGES = 64
STEP_SECONDS = 0.002
REPLAY_TIMEOUT_S = 1.0  # for each message
REPLAY_MAX_MESSAGES = 10_000  # vLLM's buffer_steps default
REPLAY_MAX_BYTES = 16 * 1024 * 1024  # held until the whole range is there
REPLAY_INTERVAL_S = 1.0
# The longest a starting sidecar stays unready reading the pods' history (4 pods' 600 batches
# took 0.9 s here); past it the sidecar serves and applies the rest as it comes.
CATCH_UP_S = 10.0
# Idle this long, the replay ROUTER is asked for any batch past the last: one connection per
# idle pod every 5 s, and a batch lost at a burst's end is found within that.
QUIET_S = 5.0
MAX_LAG_S = 3600.0
SUB_OPTIONS = (
    (zmq.LINGER, 0),
    (zmq.RCVHWM, RCVHWM),
    (zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 1024),  # a larger frame drops the peer unread
    (zmq.IPV6, 1),
)


class StepBudget:
    """Yield to the loop every STEP_MESSAGES batches or STEP_SECONDS of work: awaiting a
    ready socket never suspends, so a flood would otherwise hold the loop."""

    def __init__(self) -> None:
        self.count, self.start = 0, time.perf_counter()

    async def spend(self) -> None:
        self.count += 1
        if self.count >= STEP_MESSAGES or time.perf_counter() - self.start > STEP_SECONDS:
            await asyncio.sleep(0)
            self.count, self.start = 0, time.perf_counter()


class KvEventSink(Protocol):
    def reset(self, pod: str, known: bool) -> None:
        """Everything heard from `pod` so far is void; `known`: its cache is now empty."""

    def resume(self, pod: str) -> None:
        """Everything heard from `pod` so far is void, and events were lost: what follows
        is true, what it held before is not known."""

    def apply(self, pod: str, events: tuple[KvEvent, ...]) -> None: ...


@dataclass
class Feed:
    url: str
    next_seq: int | None = None
    replayed_below: int | None = None  # batches under it came in the connect's replay
    replayed_at: float = float("-inf")
    task: asyncio.Task[None] | None = None
    # Its first connect is over: the history replayed, or none to be had (no replay, no
    # source, a refused endpoint): what readiness waits for at start (`catching_up`).
    caught_up: bool = False


class KvEventSubscriber:
    """Follows the KV events of the pods given to `set_pods`, one task per pod."""

    def __init__(
        self,
        client: UpstreamClient,
        sink: KvEventSink,
        *,
        on_outcome: Callable[[str, str], None] = lambda pod, outcome: None,
        on_lag: Callable[[str, float], None] = lambda pod, seconds: None,
        retry_s: float = RETRY_S,
        quiet_s: float = QUIET_S,
    ) -> None:
        self.client = client
        self.sink = sink
        self.on_outcome = on_outcome
        self.on_lag = on_lag
        self.retry_s = retry_s
        self.quiet_s = quiet_s
        self.feeds: dict[str, Feed] = {}
        self.context = zmq.asyncio.Context()
        self._logged: set[tuple[str, str]] = set()
        self._given_at: float | None = None  # when set_pods first named a pod

    def set_pods(self, urls: Iterable[str]) -> None:
        wanted = set(urls)
        if self._given_at is None and wanted:
            self._given_at = time.monotonic()
        for url in [u for u in self.feeds if u not in wanted]:
            feed = self.feeds.pop(url)
            if feed.task is not None:
                feed.task.cancel()
            self._logged = {key for key in self._logged if key[0] != url}
            self.sink.reset(url, known=False)
        for url in sorted(wanted - self.feeds.keys()):
            feed = self.feeds[url] = Feed(url)
            feed.task = asyncio.create_task(self._follow(feed), name=f"kv-events {url}")

    def catching_up(self) -> str | None:
        """Why routing should not rely on the events yet (the pods' history still being
        read, at most CATCH_UP_S after the first pods were given), or None."""
        if self._given_at is None:
            return None
        waiting = sum(not feed.caught_up for feed in self.feeds.values())
        if not waiting or time.monotonic() - self._given_at > CATCH_UP_S:
            return None
        return f"reading KV events: {waiting} of {len(self.feeds)} pods' history still coming"

    async def stop(self) -> None:
        tasks = [f.task for f in self.feeds.values() if f.task is not None]
        self.feeds.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not self.context.closed:
            self.context.destroy(linger=0)

    async def _follow(self, feed: Feed) -> None:
        while True:
            try:
                await self._subscribe(feed, await self.find_source(feed.url))
                self._gone(feed, "disconnected", "the publisher went away")  # a restart?
            except SourceError as exc:
                self._note(feed, "no_source", str(exc))
            except zmq.ZMQError as exc:  # an endpoint zmq cannot use
                self._gone(feed, "disconnected", str(exc))
            feed.caught_up = True  # a pod whose events cannot be had is not waited for
            feed.next_seq = feed.replayed_below = None  # a restarted pod numbers from 0 again
            await asyncio.sleep(self.retry_s * random.uniform(0.5, 1.5))

    async def _subscribe(self, feed: Feed, source: Source) -> None:
        sub = self.context.socket(zmq.SUB)
        # zmq does not reconnect after a peer broke the protocol (a frame over MAXMSGSIZE):
        # the monitor says so, and the socket is made anew.
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            for option, value in SUB_OPTIONS:
                sub.setsockopt(option, value)
            sub.setsockopt(zmq.SUBSCRIBE, source.topic)
            sub.connect(source.endpoint)
            await self._catch_up(feed, source)
            feed.caught_up = True
            await self._consume(feed, source, sub, monitor)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def find_source(self, url: str) -> Source:
        try:
            answer = await self.client.fetch(
                "GET", url, SOURCES_PATH, timeout_s=SOURCES_TIMEOUT_S, limit=SOURCES_MAX_BYTES
            )
        except UpstreamError as exc:
            raise SourceError(exc.message) from None
        if answer.status != 200 or answer.body is None:
            raise SourceError(f"HTTP {answer.status} (or over {SOURCES_MAX_BYTES} bytes)")
        return parse_sources(answer.body, url)

    async def _consume(
        self, feed: Feed, source: Source, sub: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket
    ) -> None:
        """Until the publisher goes away: each wake-up reads what is queued, yielding to
        the loop every STEP_MESSAGES batches or STEP_SECONDS (a ready socket never does)."""
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll(timeout=round(self.quiet_s * 1000)))
            if monitor in ready:
                return
            if not ready:
                await self._catch_up(feed, source)
                continue
            budget = StepBudget()
            while int(sub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                await self._accept(feed, source, await sub.recv_multipart())
                await budget.spend()

    async def _accept(self, feed: Feed, source: Source, frames: list[bytes]) -> None:
        try:
            seq = decode_seq(frames[1]) if len(frames) == 3 else -1
        except DecodeError:
            seq = -1
        if seq < 0:
            self._lose(feed, "decode_error", "a message without a sequence number")
            feed.next_seq = None  # the next one starts over
            return
        if feed.replayed_below is not None:
            if seq < feed.replayed_below:
                return  # published while the connect's replay was read: applied already
            feed.replayed_below = None
        expected = feed.next_seq
        if expected is None or seq < expected:
            # A (re)start: whatever the pod held before is void, its history from 0 if kept.
            self.on_outcome(feed.url, "start" if expected is None else "restart")
            if seq == 0:
                self.sink.reset(feed.url, known=True)
            elif not await self._replay(feed, source, 0, seq):
                self.sink.resume(feed.url)  # its history is gone: followed from here on
        elif seq > expected and not await self._replay(feed, source, expected, seq):
            self._lose(feed, "gap", f"batches {expected}..{seq - 1} lost")
        feed.next_seq = seq + 1
        try:
            batch = decode_message(frames)
        except DecodeError as exc:
            self._lose(feed, "decode_error", str(exc))
            return
        self._deliver(feed, batch)

    async def _catch_up(self, feed: Feed, source: Source) -> None:
        """Any batch past the last one, from the replay ROUTER: with none known (on
        connect), the pod's history from 0 (without it, the first batch on the SUB socket
        decides); after QUIET_S without a batch, the rest, as a gap shows only at the next
        batch: batches lost at a burst's end (a full queue, or published before our
        subscription took effect) would otherwise stay lost while the pod is idle, and a
        cache hit publishes nothing."""
        start = feed.next_seq
        if source.replay_endpoint is None:
            return
        batches = await self._fetch(source, start or 0, None)
        # None: no answer in time, which is no sign of a loss; the next batch tells.
        if batches is None or (start is not None and not batches):
            return
        if start is None:
            self.sink.reset(feed.url, known=True)
        await self._deliver_all(feed, batches)
        feed.next_seq = feed.replayed_below = (start or 0) + len(batches)

    async def _replay(self, feed: Feed, source: Source, start: int, stop: int) -> bool:
        """Deliver batches start..stop-1 from the pod's replay socket; False when it has
        none, was asked within REPLAY_INTERVAL_S, or cannot give them all in order."""
        now = time.monotonic()
        if source.replay_endpoint is None or now - feed.replayed_at < REPLAY_INTERVAL_S:
            return False
        feed.replayed_at = now
        batches = await self._fetch(source, start, stop)
        if batches is None or len(batches) != stop - start:
            return False
        if start == 0:
            self.sink.reset(feed.url, known=True)
        await self._deliver_all(feed, batches)
        return True

    async def _fetch(self, source: Source, start: int, stop: int | None) -> list[EventBatch] | None:
        """Batches start.. from the replay ROUTER, up to `stop` (None: all it holds, to its
        end marker); None when they do not come whole and in order."""
        assert source.replay_endpoint is not None
        size, budget = 0, StepBudget()
        batches: list[EventBatch] = []
        dealer = self.context.socket(zmq.DEALER)
        try:
            for option, value in SUB_OPTIONS:
                dealer.setsockopt(option, value)
            dealer.connect(source.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(REPLAY_MAX_MESSAGES + 1):
                async with asyncio.timeout(REPLAY_TIMEOUT_S):
                    frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[0]:
                    return None
                seq = decode_seq(frames[2])
                if seq < 0 or (stop is not None and seq >= stop):
                    return batches
                if seq != start + len(batches):
                    return None  # the pod no longer holds the start, or skipped
                size += len(frames[3])
                if size > REPLAY_MAX_BYTES:
                    return None
                batches.append(decode_message(frames[1:]))
                await budget.spend()
        except (TimeoutError, DecodeError, zmq.ZMQError):
            return None
        finally:
            dealer.close(linger=0)
        return None  # more than a replay buffer holds

    async def _deliver_all(self, feed: Feed, batches: list[EventBatch]) -> None:
        """Replayed batches, in order."""
        self.on_outcome(feed.url, "replayed")
        budget = StepBudget()
        for batch in batches:
            self._deliver(feed, batch)
            await budget.spend()

    def _deliver(self, feed: Feed, batch: EventBatch) -> None:
        self.on_outcome(feed.url, "batch")
        self.on_lag(feed.url, min(max(time.time() - batch.ts, 0.0), MAX_LAG_S))
        if batch.events:
            self.sink.apply(feed.url, batch.events)

    def _lose(self, feed: Feed, reason: str, detail: str) -> None:
        """Events were lost: what the pod held is void, what follows is true."""
        self._note(feed, reason, detail)
        self.sink.resume(feed.url)

    def _gone(self, feed: Feed, reason: str, detail: str) -> None:
        """The publisher went away (a restart?): the pod is unknown until it is back."""
        self._note(feed, reason, detail)
        self.sink.reset(feed.url, known=False)

    def _note(self, feed: Feed, reason: str, detail: str) -> None:
        self.on_outcome(feed.url, reason)
        key = (feed.url, reason)
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("KV events of %s: %s: %s (logged once)", feed.url, reason, detail)
