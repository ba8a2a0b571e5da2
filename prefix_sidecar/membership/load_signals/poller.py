"""Polls /metrics of the pods whose load the traffic has not reported lately.

The ORCA header on the traffic is free; polls cost POLL_SAMPLE / POLL_INTERVAL_S requests
per second per sidecar, whatever the fleet size (arithmetic in docs/load-signals.md).
"""

from __future__ import annotations

import asyncio
import logging
import random

from prefix_sidecar.membership.load_signals.parse import MAX_METRICS_BYTES, PodReport, parse_metrics
from prefix_sidecar.membership.load_signals.rules import LoadSignals
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError

logger = logging.getLogger(__name__)

# <= 4 polls/s per sidecar, 16/s per pod at 1,000 sidecars x 250 pods; picked-among pods stay
# 1-2 s fresh, within MAX_AGE_S (docs/load-signals.md, "Arithmetic").
POLL_INTERVAL_S = 0.5
POLL_SAMPLE = 2
POLL_TIMEOUT_S = 0.5
ACCEPT_TEXT = {"Accept": "text/plain"}


class MetricsError(Exception):
    pass


async def fetch_metrics(
    client: UpstreamClient,
    url: str,
    *,
    timeout_s: float,
    max_bytes: int = MAX_METRICS_BYTES,
    path: str = "/metrics",
) -> PodReport:
    """GET the pod's /metrics: bounded in time and bytes, no redirect; parsed."""
    try:
        answer = await client.fetch(
            "GET", url, path, timeout_s=timeout_s, limit=max_bytes, headers=ACCEPT_TEXT
        )
    except UpstreamError as exc:
        raise MetricsError(f"{url}{path}: {exc.message}") from None
    if answer.status != 200:
        raise MetricsError(f"{url}{path}: HTTP {answer.status}")
    body = answer.body
    if body is None:
        raise MetricsError(f"{url}{path}: more than {max_bytes} bytes")
    text = body.decode("utf-8", "replace")
    # Parsing ~100 KiB takes ~1 ms; a page at the byte limit, ~5 ms: within one loop step.
    return parse_metrics(text)


class MetricsPoller:
    """Every ~interval_s (+-50 % jitter) asks at most `sample` pods not heard from for half
    the max reading age (refreshed before it ages out): first, at random, those we sent
    requests to lately (we are about to pick among them), then the rest."""

    def __init__(
        self,
        signals: LoadSignals,
        client: UpstreamClient,
        *,
        interval_s: float = POLL_INTERVAL_S,
        sample: int = POLL_SAMPLE,
        timeout_s: float = POLL_TIMEOUT_S,
        rng: random.Random | None = None,
    ) -> None:
        self.signals = signals
        self.client = client
        self.interval_s = interval_s
        self.sample = sample
        self.timeout_s = timeout_s
        self.refresh_after_s = signals.rule.max_age_s / 2
        self.rng = rng or random.Random()
        self.failures = 0

    def choose(self) -> list[str]:
        stale = self.signals.stale(self.refresh_after_s)
        recent = self.signals.rule.max_age_s
        now = self.signals.now()
        busy = [url for url in stale if self.signals.pods[url].sent_at >= now - recent]
        rest = [url for url in stale if self.signals.pods[url].sent_at < now - recent]
        self.rng.shuffle(busy)
        self.rng.shuffle(rest)
        return (busy + rest)[: self.sample]

    async def poll_once(self) -> None:
        chosen = self.choose()
        if chosen:
            await asyncio.gather(*(self._poll(url) for url in chosen))
        self.signals.expire()

    async def _poll(self, url: str) -> None:
        pod = self.signals.pods.get(url)
        if pod is not None:
            pod.asked_at = self.signals.now()  # a failing pod is not asked again at once
        try:
            report = await fetch_metrics(self.client, url, timeout_s=self.timeout_s)
        except MetricsError as exc:
            self.failures += 1
            logger.debug("load poll failed: %s", exc)
            return
        self.signals.observe(url, report)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s * self.rng.uniform(0.5, 1.5))
            await self.poll_once()
