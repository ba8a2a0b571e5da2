"""When each pod will have computed the prefills this sidecar has sent it: a per-pod queue,
predicted at each send and set again at each first token, in seconds of the pod's own speed,
learned from the same first tokens.

A pod computes prefills about one after another (a GPU's prefill is throughput-bound), so a
request sent to a pod with a backlog waits for it before its own prefill starts. Precise
routing weighs that wait against what a pod would compute of the prompt (routing/precise.py
to_quickest), as SGLang's and Dynamo's routers weigh queued work against cache overlap.

The rate is the pod's seconds per token over the first tokens seen lately (PrefillRate): a
request's time from when it could start (its send, or the pod's previous first token of
ours, whichever is later) to its first token, over its tokens. Each sidecar sees only its
own requests: with several, each underestimates the queues, and moves on them less. Pods
are untrusted: samples out of bounds are dropped, and the learned rate is clamped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# How much a sample's weight shrinks with each newer one: about the last 50 first tokens count.
FORGET = 0.98
# Before the first sample, the prior: 10,000 tokens/s.
PRIOR_PER_TOKEN_S = 1e-4
# Bounds on the rate: 100 to 10M tokens/s.
PER_TOKEN_S = (1e-7, 1e-2)
MAX_SAMPLE_S = 60.0  # a first token later than this after its start says nothing of the rate
# A prompt this short is mostly the request's fixed costs (the hop, the pod's scheduling):
# it says little of the pod's speed.
MIN_SAMPLE_TOKENS = 64


@dataclass
class PodQueue:
    free_at: float = 0.0  # when the prefills sent so far will be done, predicted
    waiting: int = 0  # our requests sent here without a first token yet
    tokens: int = 0  # ... and the tokens they compute
    last_first: float = 0.0  # the last first token of ours here


class PrefillRate:
    """The pod's seconds per prompt token: the seconds over the tokens of the first tokens
    seen lately, summed with forgetting.

    A line with a fixed part fitted worse: on `bench organic` (time x6, pods at 9,000 tokens/s
    real) it learned 11 ms + 40 us a token, the fixed part mostly the sidecar's own hop, which
    the pod does not queue: each request waiting counted as 275 tokens of queue, and 5-10 % of
    the requests moved, to 0.980-0.991 of the hit ceiling. The ratio counts the hop into the
    rate instead, so the queue drains a little slower than it does."""

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
        """One request left the queue: what is still waiting is all it holds from now, so a
        prediction that was off does not build up while the pod is never empty. A pod with
        none of ours waiting is forgotten (its queue is empty, and the next request's start
        is its send): the map holds only pods with requests in flight, whatever the churn."""
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
