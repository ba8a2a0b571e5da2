"""When each pod will have computed the prefills this sidecar has sent it: a per-pod queue,
predicted at each send and set right at each first token, in seconds of the pod's own speed,
learned from the same first tokens.

A pod computes prefills about one after another (a GPU's prefill is throughput-bound), so a
request sent to a pod with a backlog waits for it before its own prefill starts. Precise
routing weighs that wait against what a pod would compute of the prompt (routing/precise.py
to_quickest), as SGLang's and Dynamo's routers weigh queued work against cache overlap.

The rate is a least-squares line, seconds = fixed + per token x tokens, over the first tokens
seen lately (each weighed FORGET times the next one's): a request's time from when it could
start (its send, or the pod's previous first token of ours, whichever is later) to its first
token. Each sidecar sees only its own requests: with several, each underestimates the
queues, and moves on them less. Pods are untrusted: samples out of bounds are dropped, and
the learned line is clamped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# How much a sample's weight shrinks with each newer one: about the last 50 first tokens count.
FORGET = 0.98
# Before MIN_SAMPLES first tokens, the prior: 10,000 tokens/s, no fixed cost.
MIN_SAMPLES = 4
PRIOR_PER_TOKEN_S = 1e-4
# Bounds on the line: 100 to 10M tokens/s; up to 1 s per request besides its tokens.
PER_TOKEN_S = (1e-7, 1e-2)
MAX_FIXED_S = 1.0
MAX_SAMPLE_S = 60.0  # a first token later than this after its start says nothing of the rate


@dataclass
class PodQueue:
    free_at: float = 0.0  # when the prefills sent so far will be done, predicted
    waiting: int = 0  # our requests sent here without a first token yet
    last_first: float = 0.0  # the last first token of ours here


class PrefillRate:
    """seconds = fixed_s + per_token_s x tokens, fitted with forgetting."""

    def __init__(self) -> None:
        self.fixed_s = 0.0
        self.per_token_s = PRIOR_PER_TOKEN_S
        self._n = self._u = self._d = self._uu = self._ud = 0.0
        self.samples = 0

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    def learn(self, tokens: int, seconds: float) -> None:
        if tokens < 0 or not 0.0 < seconds <= MAX_SAMPLE_S:
            return
        self._n = self._n * FORGET + 1.0
        self._u = self._u * FORGET + tokens
        self._d = self._d * FORGET + seconds
        self._uu = self._uu * FORGET + tokens * tokens
        self._ud = self._ud * FORGET + tokens * seconds
        self.samples += 1
        spread = self._uu - self._u * self._u / self._n
        if self.samples < MIN_SAMPLES or spread <= 1.0:  # one size of prompt: no slope yet
            return
        slope = (self._ud - self._u * self._d / self._n) / spread
        low, high = PER_TOKEN_S
        self.per_token_s = min(max(slope, low), high)
        fixed = (self._d - self.per_token_s * self._u) / self._n
        self.fixed_s = min(max(fixed, 0.0), MAX_FIXED_S)


class PrefillQueues:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.rate = PrefillRate()
        self._pods: dict[str, PodQueue] = {}

    def sent(self, pod: str, tokens: int) -> float:
        """A request with `tokens` to compute was sent to `pod`; the time it was sent."""
        now = self.clock()
        queue = self._pods.setdefault(pod, PodQueue())
        queue.free_at = max(now, queue.free_at) + self.rate.seconds(max(tokens, 0))
        queue.waiting += 1
        return now

    def first_token(self, pod: str, tokens: int, sent_at: float) -> None:
        """The request sent at `sent_at` had its first token: learn the rate from it; with
        none of ours left waiting there, the pod's queue is known to be empty now."""
        now = self.clock()
        queue = self._pods.get(pod)
        if queue is None:
            return
        self.rate.learn(tokens, now - max(sent_at, queue.last_first))
        queue.last_first = now
        self._done(queue, now)

    def dropped(self, pod: str) -> None:
        """A request sent to `pod` ended without a first token."""
        queue = self._pods.get(pod)
        if queue is not None:
            self._done(queue, self.clock())

    def _done(self, queue: PodQueue, now: float) -> None:
        queue.waiting = max(queue.waiting - 1, 0)
        if not queue.waiting:
            queue.free_at = min(queue.free_at, now)

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
