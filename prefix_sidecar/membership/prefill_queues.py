"""Per-pod prefill queues: when each pod will have computed the prefills we sent it, predicted
at each send and reset at each first token, at a per-token rate learned from those first tokens.

A pod computes prefills about one after another (throughput-bound), so a request waits for
the backlog; precise routing weighs that wait against cache overlap (routing/precise.py
to_quickest). Each sidecar sees only its own requests, so it underestimates shared queues.
Pods are untrusted: out-of-bounds samples are dropped and the learned rate is clamped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

FORGET = 0.98  # per-sample decay: about the last 50 first tokens count
PRIOR_PER_TOKEN_S = 1e-4  # before the first sample: 10,000 tokens/s
PER_TOKEN_S = (1e-7, 1e-2)  # bounds on the rate: 100 to 10M tokens/s
MAX_SAMPLE_S = 60.0  # a first token later than this after its start says nothing of the rate
# Shorter prompts are mostly fixed costs (the hop, the pod's scheduling), not speed.
MIN_SAMPLE_TOKENS = 64


@dataclass
class PodQueue:
    free_at: float = 0.0  # when the prefills sent so far will be done, predicted
    waiting: int = 0  # our requests sent here without a first token yet
    tokens: int = 0  # ... and the tokens they compute
    last_first: float = 0.0  # the last first token of ours here


class PrefillRate:
    """Seconds per prompt token: a sample is a request's time from when it could start (its
    send, or our previous first token on the pod, if later) to its first token, over its
    tokens; seconds and tokens are summed with forgetting. A pure ratio, not a line with a
    fixed part: that part was mostly our own hop, which the pod does not queue (bench organic)."""

    def __init__(self) -> None:
        self.per_token_s = PRIOR_PER_TOKEN_S
        self._seconds = self._tokens = 0.0
        self.samples = 0

    def seconds(self, tokens: int) -> float:
        return self.per_token_s * tokens

    def learn(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_SAMPLE_TOKENS or not 0.0 < seconds <= MAX_SAMPLE_S:
            return
        low, high = PER_TOKEN_S
        self._seconds = self._seconds * FORGET + min(max(seconds, low * tokens), high * tokens)
        self._tokens = self._tokens * FORGET + tokens
        self.samples += 1
        self.per_token_s = self._seconds / self._tokens


class PrefillQueues:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.rate = PrefillRate()
        self._pods: dict[str, PodQueue] = {}
        # told (pod, sent_at) of each first token: precise routing ends its credits there
        # (kv_events/expected.py prefilled)
        self.first_token_listeners: list[Callable[[str, float], None]] = []

    def sent(self, pod: str, tokens: int) -> float:
        """A request with `tokens` to compute was sent to `pod`; the time it was sent."""
        now = self.clock()
        queue = self._pods.setdefault(pod, PodQueue())
        tokens = max(tokens, 0)
        queue.free_at = max(now, queue.free_at) + self.rate.seconds(tokens)
        queue.waiting += 1
        queue.tokens += tokens
        return now

    def first_token(self, pod: str, tokens: int, sent_at: float) -> None:
        """The request sent at `sent_at` with `tokens` to compute had its first token: learn
        the rate from it, and predict the pod's queue again from now."""
        for listener in self.first_token_listeners:
            listener(pod, sent_at)
        now = self.clock()
        queue = self._pods.get(pod)
        if queue is None:
            return
        self.rate.learn(tokens, now - max(sent_at, queue.last_first))
        queue.last_first = now
        self._done(pod, queue, max(tokens, 0), now)

    def dropped(self, pod: str, tokens: int) -> None:
        """A request sent to `pod` with `tokens` to compute ended without a first token."""
        queue = self._pods.get(pod)
        if queue is not None:
            self._done(pod, queue, max(tokens, 0), self.clock())

    def _done(self, pod: str, queue: PodQueue, tokens: int, now: float) -> None:
        """One request left: re-predict from what still waits, so an error does not build up
        on a never-empty pod. A pod with none of ours waiting is dropped: the map holds only
        pods with requests in flight, whatever the churn."""
        queue.waiting = max(queue.waiting - 1, 0)
        if not queue.waiting:
            del self._pods[pod]
            return
        queue.tokens = max(queue.tokens - tokens, 0)
        queue.free_at = now + self.rate.seconds(queue.tokens)

    def backlog_tokens(self, pods: Sequence[str]) -> dict[str, float]:
        """Per pod of `pods` (the fleet now: any other is forgotten), its predicted backlog
        in tokens at the learned rate."""
        now, members = self.clock(), set(pods)
        if not self._pods.keys() <= members:
            self._pods = {pod: q for pod, q in self._pods.items() if pod in members}
        per_token = self.rate.per_token_s
        backlog = dict.fromkeys(pods, 0.0)
        for pod, queue in self._pods.items():
            backlog[pod] = max(queue.free_at - now, 0.0) / per_token
        return backlog
