"""What the pods say about their own load and KV, turned into the load bounded-load picks on.

Each sidecar sees only its own in-flight requests; the pods see everyone's. vLLM tells
anyone who asks (docs/load-signals.md):
- in a response, when the request carried `endpoint-load-metrics-format: TEXT|JSON`, the
  ORCA header `endpoint-load-metrics` (queue length and KV usage) - free, it rides on the
  traffic; `parse_load_header` reads it;
- on `GET /metrics`: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` and `vllm:cache_config_info` (num_gpu_blocks x block_size =
  the pod's KV tokens); `parse_metrics` reads it, and `MetricsPoller` asks a few pods per
  interval where the traffic has not told us lately.

Everything a pod sends is untrusted: the header and the page are size-bounded, parsed in
one linear pass, and every number must be finite and in range or it is ignored.

`LoadSignals` keeps one timestamped record per pod and hands the pool one of two rules
(docs/load-signals.md). The fleet view (rule 3, the default): each fresh running + waiting
reading, which the pool moves by our requests since it, our choices among pods times the
K-estimate (K sidecars choosing alike on the same stale number would overfill a pod K times
faster than one).
The saturation report (rule 2): a pod whose fresh readings say it queues or its KV is full
is reported at a load over its bounded-load cap. A reading older than `max_age_s` is None:
the pool falls back to own in-flight counts (scaled by K in the fleet view).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp

from prefix_sidecar.upstream.capped import read_capped

logger = logging.getLogger(__name__)

FORMAT_HEADER = "endpoint-load-metrics-format"  # the request asks ...
LOAD_HEADER = "endpoint-load-metrics"  # ... the response answers
MAX_HEADER_CHARS = 2048  # vLLM's is ~90; aiohttp already stops a header at 8 KiB
MAX_HEADER_ITEMS = 32
MAX_METRICS_BYTES = 512 * 1024  # a vLLM /metrics page is ~50-150 KiB
MAX_METRICS_LINES = 20_000
MAX_REQUESTS = 1_000_000.0  # a queue longer than this is a lie, not a load
MAX_KV_TOKENS = 1 << 40

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_V0 = "vllm:gpu_cache_usage_perc"  # vLLM's v0 name of the same gauge
CACHE_INFO = "vllm:cache_config_info"
_GAUGES = (RUNNING, WAITING, KV_USAGE, KV_USAGE_V0, CACHE_INFO)
# One label: name="value" with \" \\ \n escapes; linear (no nested quantifier can backtrack).
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class PodReport:
    """One reading of a pod; None = this reading did not say."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    kv_tokens: int | None = None  # num_gpu_blocks x block_size


def _count(text: str) -> float | None:
    """A request count: finite, >= 0, at most MAX_REQUESTS; else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and 0.0 <= value <= MAX_REQUESTS else None


def _fraction(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and 0.0 <= value <= 1.0 else None


_NAMED = {"num_requests_waiting": ("waiting", _count), "kv_cache_usage_perc": ("kv", _fraction)}


def parse_load_header(value: str | None) -> PodReport | None:
    """vLLM's ORCA header (`TEXT named_metrics.x=1.0, ...` or `JSON {"named_metrics": {...}}`)
    -> a report, or None when absent, oversized, malformed or saying nothing we use.
    Unknown metrics are skipped; a known one with a bad value is dropped, not guessed."""
    if not value or len(value) > MAX_HEADER_CHARS:
        return None
    kind, _, body = value.strip().partition(" ")
    pairs: list[tuple[str, str]] = []
    if kind.upper() == "TEXT":
        for item in body.split(",", MAX_HEADER_ITEMS)[:MAX_HEADER_ITEMS]:
            key, sep, number = item.strip().partition("=")
            if sep and key.startswith("named_metrics."):
                pairs.append((key[len("named_metrics.") :], number.strip()))
    elif kind.upper() == "JSON":
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return None
        named = data.get("named_metrics") if isinstance(data, dict) else None
        if not isinstance(named, dict):
            return None
        for key, number in list(named.items())[:MAX_HEADER_ITEMS]:
            # bool is an int: refuse it (and strings, lists...) rather than read 1.0
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                pairs.append((str(key), str(number)))  # str of a huge int fails float(): None
    else:
        return None
    found: dict[str, float] = {}
    for key, number in pairs:
        known = _NAMED.get(key)
        if known is not None:
            parsed = known[1](number)
            if parsed is not None:
                found[known[0]] = parsed
    if not found:
        return None
    return PodReport(waiting=found.get("waiting"), kv_usage=found.get("kv"))


def _sample(line: str) -> tuple[str, str, str] | None:
    """`name{labels} value [timestamp]` -> (name, labels, value); None if not a sample."""
    brace = line.find("{")
    if brace < 0:
        name, _, rest = line.partition(" ")
        labels = ""
    else:
        end = line.rfind("}")
        if end < brace:
            return None
        name, labels, rest = line[:brace], line[brace + 1 : end], line[end + 1 :]
    parts = rest.split()
    return (name.strip(), labels, parts[0]) if parts else None


def parse_metrics(text: str) -> PodReport:
    """The gauges we use from a Prometheus text page, in one pass over at most
    MAX_METRICS_LINES lines. Several engines (data parallel) each export a sample: running
    and waiting add up, KV usage is the fullest engine's, the KV size the smallest."""
    running = waiting = kv_usage = None
    kv_tokens: int | None = None
    for line in text.split("\n", MAX_METRICS_LINES)[:MAX_METRICS_LINES]:
        if not line.startswith(_GAUGES):
            continue
        sample = _sample(line)
        if sample is None:
            continue
        name, labels, number = sample
        if name == RUNNING and (value := _count(number)) is not None:
            running = min(MAX_REQUESTS, (running or 0.0) + value)
        elif name == WAITING and (value := _count(number)) is not None:
            waiting = min(MAX_REQUESTS, (waiting or 0.0) + value)
        elif name in (KV_USAGE, KV_USAGE_V0) and (value := _fraction(number)) is not None:
            kv_usage = value if kv_usage is None else max(kv_usage, value)
        elif name == CACHE_INFO:
            tokens = _cache_tokens(labels)
            if tokens is not None:
                kv_tokens = tokens if kv_tokens is None else min(kv_tokens, tokens)
    return PodReport(running, waiting, kv_usage, kv_tokens)


def _cache_tokens(labels: str) -> int | None:
    """num_gpu_blocks x block_size from vllm:cache_config_info's labels (both integers > 0)."""
    if len(labels) > 8192:
        return None
    found = dict(_LABEL.findall(labels))
    blocks, size = found.get("num_gpu_blocks", ""), found.get("block_size", "")
    if not (blocks.isdigit() and size.isdigit() and len(blocks) <= 12 and len(size) <= 6):
        return None
    tokens = int(blocks) * int(size)
    return tokens if 0 < tokens <= MAX_KV_TOKENS else None


@dataclass(frozen=True)
class LoadRule:
    """When a pod's readings say it is saturated (the routing contract text is in
    docs/load-signals.md)."""

    max_age_s: float = 2.0  # older readings are unknown
    kv_threshold: float = 0.95  # KV usage at or above this: the pod is saturated

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
    """Per-pod readings -> `on_load(url, load | None)` whenever a pod's reported load
    changes, and the pods' KV sizes -> `on_kv(tokens | None)` whenever the agreed size
    changes.

    A saturated pod is reported at `over_cap(url)`: the load that puts it over its bounded-
    load cap as things stand (the pool's own in-flight count plus the pod's cap), so every
    sidecar spills past it while it queues; any other pod is reported None (own in-flight
    decides). Without `over_cap` nothing is reported (readings are still kept)."""

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
        """The fleet view after every pod became saturated, or one stopped being: while all
        are, no reading is used (each sidecar's own live counts spread an overload better
        than readings up to an interval old that all say "full"); after, the fresh ones."""
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
        reported: all of them over their caps would send every pick to the least loaded by
        readings up to an interval old, i.e. all sidecars to one pod until the next reading
        (measured); each sidecar's own live counts spread the overload better."""
        # The fleet view asks whether every pod queues; KV use alone does not count there:
        # a prefix cache budgeted to its pods' KV runs near full by design (measured: bench
        # fleet's pods at 93-95 % pinned: 5 of 17 spills of an 8-sidecar run came while every pod
        # counted own in-flight for that, 0-1 of 15-16 without).
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


class MetricsError(Exception):
    pass


async def fetch_metrics(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout_s: float,
    max_bytes: int = MAX_METRICS_BYTES,
    path: str = "/metrics",
) -> PodReport:
    """GET the pod's /metrics: bounded in time and bytes, no redirect; parsed."""
    try:
        async with session.get(
            url + path,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            allow_redirects=False,
            headers={"Accept": "text/plain"},
        ) as response:
            if response.status != 200:
                raise MetricsError(f"{url}{path}: HTTP {response.status}")
            body = await read_capped(response, max_bytes)
            if body is None:
                raise MetricsError(f"{url}{path}: more than {max_bytes} bytes")
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise MetricsError(f"{url}{path}: {exc.__class__.__name__}") from None
    text = body.decode("utf-8", "replace")
    # Parsing ~100 KiB takes ~1 ms; a page at the byte limit, ~5 ms: within one loop step.
    return parse_metrics(text)


class MetricsPoller:
    """Every ~interval_s (jittered +-50 %, so a thousand sidecars do not poll in step) ask
    at most `sample` pods for /metrics, chosen among the ones not heard from for
    refresh_after_s: first those this sidecar sent requests to lately (it is about to pick
    among them), then the rest, at random. Cost per sidecar: sample / interval_s requests
    per second, whatever the fleet size (arithmetic in docs/load-signals.md)."""

    def __init__(
        self,
        signals: LoadSignals,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 0.5,
        sample: int = 2,
        timeout_s: float = 0.5,
        refresh_after_s: float | None = None,
        max_bytes: int = MAX_METRICS_BYTES,
        rng: random.Random | None = None,
    ) -> None:
        self.signals = signals
        self.session = session
        self.interval_s = interval_s
        self.sample = sample
        self.timeout_s = timeout_s
        self.refresh_after_s = (
            refresh_after_s if refresh_after_s is not None else signals.rule.max_age_s / 2
        )
        self.max_bytes = max_bytes
        self.rng = rng or random.Random()
        self.polls = 0
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
        self.polls += 1
        pod = self.signals.pods.get(url)
        if pod is not None:
            pod.asked_at = self.signals.now()  # a failing pod is not asked again at once
        try:
            report = await fetch_metrics(
                self.session, url, timeout_s=self.timeout_s, max_bytes=self.max_bytes
            )
        except MetricsError as exc:
            self.failures += 1
            logger.debug("load poll failed: %s", exc)
            return
        self.signals.observe(url, report)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s * self.rng.uniform(0.5, 1.5))
            await self.poll_once()
