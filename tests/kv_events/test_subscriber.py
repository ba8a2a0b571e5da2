"""The subscriber against a publisher on real sockets (tests/kv_events/publisher.py): in
order, gaps replayed, a restart and an unreplayable gap taken as a reset, and a hostile
publisher (garbage, a 100 MB batch, a flood) costing that pod's events and one log line,
never a loop turn over 10 ms."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import zmq

from prefix_sidecar.kv_events import subscriber as subscriber_module
from prefix_sidecar.kv_events.decode import BlockStored, KvEvent
from prefix_sidecar.kv_events.sources import SourceError, parse_sources
from prefix_sidecar.kv_events.subscriber import KvEventSubscriber
from prefix_sidecar.upstream.client import UpstreamClient
from tests.background import LoopWatch
from tests.kv_events.publisher import TOPIC, Publisher, RecordingSink, payload, stored


@contextlib.asynccontextmanager
async def following(
    publisher: Publisher, quiet_s: float = 60.0
) -> AsyncIterator[tuple[RecordingSink, Counter[str]]]:
    sink, outcomes = RecordingSink(), Counter[str]()
    async with UpstreamClient() as client:
        subscriber = KvEventSubscriber(
            client,
            sink,
            on_outcome=lambda pod, outcome: outcomes.update([outcome]),
            retry_s=0.2,
            quiet_s=quiet_s,
        )
        subscriber.set_pods([publisher.url])
        try:
            await publisher.subscribed()
            yield sink, outcomes
        finally:
            await subscriber.stop()


def hashes(sink: RecordingSink) -> list[int]:
    return [h for e in sink.events() if isinstance(e, BlockStored) for h in e.block_hashes]


async def test_batches_arrive_in_order_from_a_known_start() -> None:
    async with Publisher() as publisher, following(publisher) as (sink, outcomes):
        for seq in range(3):
            await publisher.send(seq, payload(stored(2**64 - 1 - seq)))
        await sink.until(lambda: len(hashes(sink)) == 3)
    assert sink.heard[0] == ("reset", True)  # seq 0: the pod's cache starts empty
    assert hashes(sink) == [2**64 - 1, 2**64 - 2, 2**64 - 3]
    assert outcomes["batch"] == 3


async def test_a_gap_is_replayed_in_order() -> None:
    async with Publisher() as publisher, following(publisher) as (sink, outcomes):
        # the connect's replay of the (empty) history first: else, run after the sends, it
        # would fill the gap itself and this would test the history, not the gap
        await sink.until(lambda: outcomes["replayed"] == 1)
        await publisher.send(0, payload(stored(10)))
        await publisher.send(1, payload(stored(11)), publish=False)
        await publisher.send(2, payload(stored(12)), publish=False)
        await publisher.send(3, payload(stored(13)))
        await sink.until(lambda: len(hashes(sink)) == 4)
    assert hashes(sink) == [10, 11, 12, 13]
    assert [h for h in sink.heard if h[0] == "reset"] == [("reset", True)]
    assert outcomes["replayed"] == 2 and outcomes["gap"] == 0  # the history, then the gap


async def test_a_late_subscriber_replays_the_history_from_zero() -> None:
    async with Publisher() as publisher:
        await publisher.send(0, payload(stored(1)), publish=False)
        await publisher.send(1, payload(stored(2)), publish=False)
        async with following(publisher) as (sink, _):
            await publisher.send(2, payload(stored(3)))
            await sink.until(lambda: len(hashes(sink)) == 3)
    assert sink.heard[0] == ("reset", True) and hashes(sink) == [1, 2, 3]


async def test_the_history_is_known_on_connect_before_any_new_batch() -> None:
    # A restarted pod's warm-up prewarm was published before we reconnected, and a cache hit
    # publishes nothing: without the replay on connect an idle pod would stay unknown.
    async with Publisher() as publisher:
        for seq in range(3):
            await publisher.send(seq, payload(stored(seq + 1)), publish=False)
        async with following(publisher) as (sink, outcomes):
            await sink.until(lambda: len(hashes(sink)) == 3)
    assert sink.heard[0] == ("reset", True) and hashes(sink) == [1, 2, 3]
    assert outcomes["replayed"] == 1 and outcomes["batch"] == 3


async def test_a_batch_both_replayed_and_published_counts_once() -> None:
    async with Publisher(replay_delay_s=0.3) as publisher:
        await publisher.send(0, payload(stored(1)), publish=False)
        async with following(publisher) as (sink, outcomes):
            await publisher.send(1, payload(stored(2)))  # on SUB, and in the late replay
            await sink.until(lambda: outcomes["replayed"] == 1)
            await publisher.send(2, payload(stored(3)))
            await sink.until(lambda: len(hashes(sink)) >= 3)
    assert hashes(sink) == [1, 2, 3]
    assert [h for h in sink.heard if h[0] == "reset"] == [("reset", True)]
    assert outcomes["gap"] == 0 and outcomes["restart"] == 0


async def test_a_batch_lost_at_the_end_of_a_burst_is_found_while_the_pod_is_idle() -> None:
    # A gap shows only at the next batch; an idle pod sends none (a hit publishes nothing).
    async with Publisher() as publisher, following(publisher, quiet_s=0.3) as (sink, outcomes):
        await publisher.send(0, payload(stored(1)))
        await publisher.send(1, payload(stored(2)), publish=False)  # dropped, and then quiet
        await sink.until(lambda: len(hashes(sink)) == 2)
        await publisher.send(2, payload(stored(3)))  # what the probe read is not a restart
        await sink.until(lambda: len(hashes(sink)) == 3)
    assert hashes(sink) == [1, 2, 3]
    assert [h for h in sink.heard if h[0] == "reset"] == [("reset", True)]
    assert outcomes["gap"] == 0 and outcomes["restart"] == 0


async def test_an_unanswered_replay_on_connect_is_asked_again_while_the_pod_is_idle() -> None:
    # Its history was published before our subscription took effect, and no batch follows.
    async with Publisher(replay_ignored=1) as publisher:
        await publisher.send(0, payload(stored(1)), publish=False)
        async with following(publisher, quiet_s=0.3) as (sink, outcomes):
            await sink.until(lambda: hashes(sink) == [1])
    assert sink.heard[0] == ("reset", True) and outcomes["replayed"] == 1


async def test_a_gap_without_replay_voids_what_was_held_and_follows_on() -> None:
    async with Publisher(replay=False) as publisher, following(publisher) as (sink, outcomes):
        await publisher.send(0, payload(stored(1)))
        await publisher.send(5, payload(stored(6)))
        await sink.until(lambda: len(hashes(sink)) == 2)
    assert sink.heard == [
        ("reset", True),
        ("events", (BlockStored((1,), None, (0, 1), 2),)),
        ("resume", None),
        ("events", (BlockStored((6,), None, (0, 1), 2),)),
    ]
    assert outcomes["gap"] == 1


async def test_a_long_running_pod_is_followed_from_its_next_batch() -> None:
    # Its replay buffer no longer holds batch 0 (vLLM keeps the last 10,000): its history
    # is gone, but what it stores from now on is true, and a sidecar that starts late must
    # not leave the pod unknown for good.
    async with Publisher() as publisher:
        publisher.held += [(seq, payload(stored(seq))) for seq in range(5, 10)]
        async with following(publisher) as (sink, outcomes):
            await publisher.send(10, payload(stored(10)))
            await sink.until(lambda: hashes(sink) == [10])
    assert sink.heard[0] == ("resume", None) and outcomes["start"] == 1


async def test_a_sequence_going_backwards_is_a_restart() -> None:
    async with Publisher(replay=False) as publisher, following(publisher) as (sink, outcomes):
        for seq in (0, 1, 2, 0):
            await publisher.send(seq, payload(stored(seq + 100)))
        await publisher.send(1, payload(stored(200)))
        await sink.until(lambda: len(hashes(sink)) == 5)
    resets = [h for h in sink.heard if h[0] == "reset"]
    assert resets == [("reset", True), ("reset", True)]  # back to 0: a fresh, empty cache
    assert outcomes["restart"] == 1 and hashes(sink)[-2:] == [100, 200]


async def test_garbage_is_counted_logged_once_and_survived(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    async with Publisher(replay=False) as publisher, following(publisher) as (sink, outcomes):
        await publisher.send(0, payload(stored(1)))
        for seq in (1, 2, 3):
            await publisher.send(seq, b"\xc1garbage")
        await publisher.send_frames([TOPIC, b"short", b""])
        await publisher.send_frames([TOPIC + b" one frame"])
        await publisher.send(4, payload(stored(5)))
        await sink.until(lambda: len(hashes(sink)) == 2)
    assert outcomes["decode_error"] == 5
    logged = [r for r in caplog.records if "decode_error" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    assert ("resume", None) in sink.heard and hashes(sink) == [1, 5]


async def test_a_100_mb_batch_is_refused_unbuffered() -> None:
    """zmq drops the peer at the frame header (MAXMSGSIZE), so it is never read into
    memory; the reconnection shows as a gap."""
    huge = bytes(100 * 1024 * 1024)  # made, and sent uncopied, off the watch's account
    # A second try only when the first had a long turn (10.7 ms once in CI, where runs alone
    # stay far under; the publisher shares the watched loop): a subscriber that reads the
    # batch into memory holds the loop on every try.
    for _ in range(2):
        async with (
            Publisher(replay=False) as publisher,
            following(publisher) as (sink, outcomes),
        ):
            await publisher.send(0, payload(stored(1)))
            await sink.until(lambda: len(hashes(sink)) == 1)
            async with LoopWatch() as watch:
                frames = [TOPIC, (1).to_bytes(8, "big"), huge]
                await publisher.pub.send_multipart(frames, copy=False)
                seq = 2
                while len(hashes(sink)) < 2:  # until the subscriber is back
                    await publisher.send(seq, payload(stored(seq)))
                    seq += 1
                    await asyncio.sleep(0.05)
        assert outcomes["disconnected"] == 1 and outcomes["start"] == 2  # from scratch
        assert outcomes["decode_error"] == 0 and ("reset", False) in sink.heard
        if watch.cpu_ms < 10:
            break
    assert watch.cpu_ms < 10, f"a loop turn of {watch.cpu_ms:.1f} ms CPU"


FLOOD = """
import sys, time, msgpack, zmq
port, seconds = int(sys.argv[1]), float(sys.argv[2])
pub = zmq.Context().socket(zmq.PUB)
pub.setsockopt(zmq.SNDHWM, 0)
pub.bind(f"tcp://127.0.0.1:{port}")
stored = [{"type": "BlockStored", "block_hashes": [i], "parent_block_hash": None,
           "token_ids": list(range(16)), "block_size": 16} for i in range(50)]
body = msgpack.packb([time.time(), stored, 0])
seq, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    for _ in range(1000):
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), body])
        seq += 1
print(seq)
"""


class CountingSink(RecordingSink):
    """Keeps no events: a sink holding a flood's would make the collector's work the test's."""

    def apply(self, pod: str, events: tuple[KvEvent, ...]) -> None:
        self.heard.append(("events", len(events)))
        self.heard = self.heard[-10:]


async def test_a_flood_never_holds_the_loop_over_10_ms() -> None:
    """vLLM's publisher at full speed from a process of its own, batches of 50 events."""
    async with Publisher(replay=False) as publisher:
        endpoint = publisher.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        publisher.pub.close(linger=0)  # the flooding process publishes on its port instead
        port = endpoint.rsplit(":", 1)[1]
        sink, outcomes = CountingSink(), Counter[str]()
        flood = await asyncio.create_subprocess_exec(
            sys.executable, "-c", FLOOD, port, "30", stdout=asyncio.subprocess.DEVNULL
        )
        try:
            async with UpstreamClient() as client:
                subscriber = KvEventSubscriber(
                    client, sink, on_outcome=lambda pod, o: outcomes.update([o]), retry_s=0.2
                )
                subscriber.set_pods([publisher.url])
                await sink.until(lambda: outcomes["batch"] > 0, timeout_s=30)  # it has started
                # As `serve` does once started: the heap so far (pytest's too) is out of the
                # collector's reach, so a full collection does not walk it on the loop.
                gc.freeze()
                # A second window only when the first had a long turn: alone the longest is
                # 2.3-2.4 ms of CPU, one CI run on the shared 2-core VM saw 22.9 ms once; a
                # step that holds the loop does so in every window of a flood.
                for _ in range(2):
                    first = outcomes["batch"]
                    async with LoopWatch() as watch:
                        await asyncio.sleep(3.0)
                    handled = outcomes["batch"] - first
                    if watch.cpu_ms < 10:
                        break
                await subscriber.stop()
        finally:
            gc.unfreeze()
            flood.kill()
            await flood.wait()
    print(
        f"flood: {handled} batches of 50 events handled in 3 s ({handled * 50 / 3:,.0f} "
        f"events/s), {outcomes['gap']} gaps; longest loop turn {watch.cpu_ms:.1f} ms CPU, "
        f"{watch.wall_ms:.1f} ms wall"
    )
    assert handled > 100
    assert watch.cpu_ms < 10, f"a loop turn of {watch.cpu_ms:.1f} ms CPU"


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b"{}",
        b"not json",
        b'{"0": {"publisher": "zmq", "endpoint": "tcp://10.0.0.9:5557"}}',  # pod connects out
        b'{"0": {"publisher": "zmq", "endpoint": "ipc:///tmp/x"}}',
        b'{"0": {"publisher": "zmq", "endpoint": "tcp://*:99999"}}',
        b'{"0": {"publisher": "null"}}',
    ],
)
def test_unusable_sources_are_refused(body: bytes) -> None:
    with pytest.raises(SourceError):
        parse_sources(body, "http://10.1.2.3:8000")


def test_a_wildcard_host_is_the_pods_own() -> None:
    body = (
        b'{"0": {"publisher": "zmq", "endpoint": "tcp://*:5557",'
        b' "replay_endpoint": "tcp://*:5558", "topic": "kv"}}'
    )
    source = parse_sources(body, "http://10.1.2.3:8000")
    assert (source.endpoint, source.replay_endpoint) == (
        "tcp://10.1.2.3:5557",
        "tcp://10.1.2.3:5558",
    )
    assert parse_sources(body, "http://[fd00::1]:8000").endpoint == "tcp://[fd00::1]:5557"


async def test_a_starting_sidecar_waits_for_the_pods_history_and_no_longer() -> None:
    # Readiness holds while the history is read: routed meanwhile, a request would be
    # placed on half of what the pods hold.
    async with Publisher(replay_delay_s=0.5) as publisher, UpstreamClient() as client:
        for seq in range(3):
            await publisher.send(seq, payload(stored(seq + 1)), publish=False)
        sink = RecordingSink()
        subscriber = KvEventSubscriber(client, sink, retry_s=0.2)
        assert subscriber.catching_up() is None  # no pod given yet: nothing to wait for
        subscriber.set_pods([publisher.url, "http://127.0.0.1:9"])  # the second: no source
        try:
            assert subscriber.catching_up() == (
                "reading KV events: 2 of 2 pods' history still coming"
            )
            await sink.until(lambda: len(hashes(sink)) == 3)
            await asyncio.sleep(0.05)
            assert subscriber.catching_up() is None
        finally:
            await subscriber.stop()


async def test_a_slow_history_holds_a_start_for_catch_up_s_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(subscriber_module, "CATCH_UP_S", 0.2)
    async with Publisher(replay_delay_s=0.8) as publisher, UpstreamClient() as client:
        await publisher.send(0, payload(stored(1)), publish=False)
        subscriber = KvEventSubscriber(client, RecordingSink(), retry_s=0.2)
        subscriber.set_pods([publisher.url])
        try:
            assert subscriber.catching_up() is not None
            await asyncio.sleep(0.3)
            assert not subscriber.feeds[publisher.url].caught_up
            assert subscriber.catching_up() is None  # served on, the history applied later
        finally:
            await subscriber.stop()
