"""membership/prefill_queues.py: the pods' prefill queues as this sidecar's sends fill them,
and the pod's speed learned from the first tokens."""

from __future__ import annotations

import pytest

from prefix_sidecar.membership import prefill_queues
from prefix_sidecar.membership.prefill_queues import PrefillQueues

POD, OTHER = "http://127.0.0.1:1", "http://127.0.0.1:2"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def served_one_at_a_time(queues: PrefillQueues, clock: Clock, sizes: list[int]) -> None:
    """Each prompt sent to an idle POD, its first token 0.5 ms a token later."""
    for tokens in sizes:
        sent_at = queues.sent(POD, tokens)
        clock.now += 0.0005 * tokens
        queues.first_token(POD, tokens, sent_at)
        clock.now += 1.0


def test_the_pods_speed_is_learned_from_its_first_tokens() -> None:
    clock = Clock()
    queues = PrefillQueues(clock)
    assert queues.rate.per_token_s == prefill_queues.PRIOR_PER_TOKEN_S
    served_one_at_a_time(queues, clock, [100, 1000, 300, 2000, 50, 700])
    assert queues.rate.per_token_s == pytest.approx(0.0005, rel=1e-6)
    assert queues.rate.samples == 5  # 50 tokens say little of the rate: not counted


def test_a_backlog_builds_with_each_send_and_empties_at_the_last_first_token() -> None:
    clock = Clock()
    queues = PrefillQueues(clock)
    served_one_at_a_time(queues, clock, [100, 1000, 300, 2000])
    first = queues.sent(POD, 1000)
    queues.sent(POD, 1000)
    backlog = queues.backlog_tokens([POD, OTHER])
    assert backlog[OTHER] == 0.0
    assert backlog[POD] == pytest.approx(2000)
    clock.now += 0.3  # 600 tokens' time
    assert queues.backlog_tokens([POD])[POD] == pytest.approx(1400)
    clock.now += 0.4  # the first is done later than predicted; the second still waits
    queues.first_token(POD, 1000, first)
    assert queues.backlog_tokens([POD])[POD] == pytest.approx(1000)  # all of the second's
    queues.dropped(POD, 1000)  # the second failed: nothing of ours is queued there now
    assert queues.backlog_tokens([POD])[POD] == 0.0


def test_untrusted_timings_do_not_move_the_rate_out_of_its_bounds() -> None:
    clock = Clock()
    queues = PrefillQueues(clock)
    rate = queues.rate
    rate.learn(1000, -1.0)  # a first token before its send
    rate.learn(1000, prefill_queues.MAX_SAMPLE_S + 1)  # a pod that stalled
    rate.learn(-5, 0.1)
    assert rate.samples == 0
    low, high = prefill_queues.PER_TOKEN_S
    rate.learn(10_000, 1e-9)  # a pod that answers at once
    assert rate.per_token_s == low
    for _ in range(500):  # ... then stalls on every prompt
        rate.learn(prefill_queues.MIN_SAMPLE_TOKENS, prefill_queues.MAX_SAMPLE_S)
    assert rate.per_token_s == pytest.approx(high, rel=1e-3)


def test_pods_that_left_the_fleet_are_forgotten() -> None:
    queues = PrefillQueues(Clock())
    queues.sent(POD, 500)
    queues.sent(OTHER, 500)
    assert set(queues.backlog_tokens([OTHER])) == {OTHER}
    assert queues.backlog_tokens([POD, OTHER])[POD] == 0.0  # nothing kept of it


def test_only_pods_with_requests_in_flight_are_kept() -> None:
    """Pods come and go (new addresses on every restart): a pod is kept while a request of
    ours waits on it, so the map stays as small as the requests in flight."""
    clock = Clock()
    queues = PrefillQueues(clock)
    for n in range(1000):
        pod = f"http://10.0.{n // 250}.{n % 250}:8000"
        sent_at = queues.sent(pod, 100)
        clock.now += 0.01
        if n % 2:
            queues.first_token(pod, 100, sent_at)
        else:
            queues.dropped(pod, 100)
    assert queues._pods == {}


def test_each_first_token_is_told_to_the_listeners_with_its_send_time() -> None:
    clock = Clock()
    queues = PrefillQueues(clock)
    told: list[tuple[str, float]] = []
    queues.first_token_listeners.append(lambda pod, sent_at: told.append((pod, sent_at)))
    sent_at = queues.sent(POD, 100)
    clock.now += 0.05
    queues.first_token(POD, 100, sent_at)
    queues.first_token(OTHER, 100, 99.0)  # a pod it holds no queue for: told all the same
    assert told == [(POD, sent_at), (OTHER, 99.0)]
