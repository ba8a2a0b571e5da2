"""A pod's load from untrusted text: vLLM's ORCA response header (`parse_load_header`: queue
and KV usage, sent when the request asks via `endpoint-load-metrics-format`) and its
Prometheus /metrics page (`parse_metrics`: running, waiting, KV usage and KV size).

Both are size-bounded and parsed in one linear pass; a number that is not finite and in
range is ignored. A reading is a `PodReport`, None where the pod did not say.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

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


def _number(text: str, high: float) -> float | None:
    """`text` as a number from 0 to `high` (NaN and infinities are not); else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value <= high else None


# A header's metric -> (the field it fills, its highest value)
_NAMED = {"num_requests_waiting": ("waiting", MAX_REQUESTS), "kv_cache_usage_perc": ("kv", 1.0)}


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
            field, high = known
            parsed = _number(number, high)
            if parsed is not None:
                found[field] = parsed
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
        if name == RUNNING and (value := _number(number, MAX_REQUESTS)) is not None:
            running = min(MAX_REQUESTS, (running or 0.0) + value)
        elif name == WAITING and (value := _number(number, MAX_REQUESTS)) is not None:
            waiting = min(MAX_REQUESTS, (waiting or 0.0) + value)
        elif name in (KV_USAGE, KV_USAGE_V0) and (value := _number(number, 1.0)) is not None:
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
