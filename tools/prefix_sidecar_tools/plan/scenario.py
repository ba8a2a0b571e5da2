"""A planning scenario: traffic, pod model, routing and prices, from flags and/or a YAML file.

Every field is checked here; a scenario that cannot be planned at all (shares that do not
sum to 1, a prefix larger than a pod's KV) raises ScenarioError, whose message says what is
impossible and why. (An SLO no pod count can meet is found by the capacity model.)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import yaml

from prefix_sidecar_tools.cost import CostParams

SHARE_TOLERANCE = 1e-3
MISS_MODELS = ("whole", "partial")
MAX_PREFIXES = 1024
MAX_SCENARIO_BYTES = 1 << 20


class ScenarioError(ValueError):
    """An impossible or malformed scenario; the message says what and why."""


@dataclass(frozen=True)
class Prefix:
    name: str
    tokens: int
    share: float  # fraction of requests carrying this prefix
    hit_rate: float | None = None  # fraction of its tokens served cached; None: routing's


@dataclass(frozen=True)
class Traffic:
    peak_rps: float = 8_500.0
    prefixes: tuple[Prefix, ...] = (Prefix("rules", 60_000, 1.0),)
    query_tokens: int = 200
    output_tokens: int = 500
    slo_ms: float = 210.0  # TTFT p99
    no_cache_slo_ms: float | None = None  # the no-cache column's own SLO; None: slo_ms
    requests_per_day: float = 20_000_000


@dataclass(frozen=True)
class Pod:
    """One pod (the emulator's flags, docs/emulator.md), plus what a fleet needs to know."""

    prefill_tps: float = 16_000.0  # per prefill slot
    prefill_overhead_ms: float = 12.0
    prefill_slots: int = 1
    decode_tps: float = 35.0  # per running request
    max_running: int = 64
    kv_tokens: int = 400_000
    gpus: int = 1  # GPUs per pod
    kv_counts_output: bool = True  # vLLM: output tokens take KV; the emulator: they do not
    overhead_ms: float = 0.0  # outside the pod: network, router, client (added to TTFT)


@dataclass(frozen=True)
class Routing:
    hit_rate: float | None = None  # overall prefix-token hit rate; per-prefix rates win
    miss: str = "whole"  # whole: a miss recomputes the prefix; partial: every request a part
    source: str = "flag"  # where the hit rate came from (flag, metrics URL, measure)


@dataclass(frozen=True)
class Scenario:
    traffic: Traffic = field(default_factory=Traffic)
    pod: Pod = field(default_factory=Pod)
    routing: Routing = field(default_factory=Routing)
    prices: CostParams = field(default_factory=CostParams)
    name: str = "custom"

    def hit_rate_of(self, prefix: Prefix) -> float:
        if prefix.hit_rate is not None:
            return prefix.hit_rate
        return self.routing.hit_rate if self.routing.hit_rate is not None else 1.0

    def token_hit_rate(self) -> float:
        """Prefix-token hit rate over the mix: sum(share x tokens x hit) / sum(share x tokens)."""
        prefixes = self.traffic.prefixes
        total = sum(p.share * p.tokens for p in prefixes)
        hits = sum(p.share * p.tokens * self.hit_rate_of(p) for p in prefixes)
        return hits / total if total else 0.0

    def mean_prefix_tokens(self) -> float:
        return sum(p.share * p.tokens for p in self.traffic.prefixes)

    def with_hit_rates(
        self, rates: dict[str, float], overall: float | None, source: str
    ) -> Scenario:
        prefixes = tuple(
            dataclasses.replace(p, hit_rate=rates.get(p.name, p.hit_rate))
            for p in self.traffic.prefixes
        )
        return dataclasses.replace(
            self,
            traffic=dataclasses.replace(self.traffic, prefixes=prefixes),
            routing=dataclasses.replace(
                self.routing,
                hit_rate=overall if overall is not None else self.routing.hit_rate,
                source=source,
            ),
        )


def _positive(where: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ScenarioError(f"{where} must be a number > 0, got {value!r}")


def _fraction(where: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, int | float) and 0.0 <= value <= 1.0):
        raise ScenarioError(f"{where} must be within [0, 1], got {value!r}")


def validate(scenario: Scenario) -> None:
    """Raise ScenarioError for anything that cannot be planned, saying what and why."""
    t, pod, routing = scenario.traffic, scenario.pod, scenario.routing
    for name in ("peak_rps", "slo_ms", "requests_per_day"):
        _positive(f"traffic.{name}", getattr(t, name))
    if t.no_cache_slo_ms is not None:
        _positive("traffic.no_cache_slo_ms", t.no_cache_slo_ms)
    for name in ("query_tokens", "output_tokens"):
        _positive(f"traffic.{name}", getattr(t, name))
    for name in ("prefill_tps", "decode_tps", "max_running", "kv_tokens", "gpus", "prefill_slots"):
        _positive(f"pod.{name}", getattr(pod, name))
    for name in ("prefill_overhead_ms", "overhead_ms"):
        if not (math.isfinite(getattr(pod, name)) and getattr(pod, name) >= 0):
            raise ScenarioError(f"pod.{name} must be >= 0, got {getattr(pod, name)!r}")
    if routing.miss not in MISS_MODELS:
        raise ScenarioError(f"routing.miss must be one of {MISS_MODELS}, got {routing.miss!r}")
    _fraction("routing.hit_rate", routing.hit_rate)
    if not t.prefixes:
        raise ScenarioError("the prefix mix is empty: give at least one prefix")
    if len(t.prefixes) > MAX_PREFIXES:
        raise ScenarioError(f"{len(t.prefixes)} prefixes; the planner takes up to {MAX_PREFIXES}")
    names = [p.name for p in t.prefixes]
    if len(set(names)) != len(names):
        raise ScenarioError(f"prefix names repeat: {names}")
    for p in t.prefixes:
        _positive(f"prefix {p.name!r} tokens", p.tokens)
        _fraction(f"prefix {p.name!r} share", p.share)
        _fraction(f"prefix {p.name!r} hit_rate", p.hit_rate)
    total = sum(p.share for p in t.prefixes)
    if abs(total - 1.0) > SHARE_TOLERANCE:
        raise ScenarioError(
            f"prefix shares sum to {total:.4g}, not 1: each share is the fraction of requests "
            f"carrying that prefix, so together they must cover every request "
            f"({', '.join(f'{p.name} {p.share:g}' for p in t.prefixes)})"
        )
    own = t.query_tokens + (t.output_tokens if pod.kv_counts_output else 0)
    for p in t.prefixes:
        if p.tokens + own > pod.kv_tokens:
            raise ScenarioError(
                f"prefix {p.name!r} is larger than KV: {p.tokens:,} prefix + {own:,} own tokens "
                f"per request > a pod's KV of {pod.kv_tokens:,} tokens, so no pod can ever hold "
                f"it (raise pod.kv_tokens, e.g. more GPUs per pod, or shorten the prefix)"
            )
    scenario.prices.validate()


# --- YAML ---------------------------------------------------------------------------------

_SECTIONS = {"traffic": Traffic, "pod": Pod, "routing": Routing, "prices": CostParams}


def _section(kind: type, name: str, raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ScenarioError(
            f"scenario section {name!r} must be a mapping, got {type(raw).__name__}"
        )
    known = {f.name: f for f in dataclasses.fields(kind)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known or key == "prefixes":
            raise ScenarioError(
                f"unknown key {name}.{key}; known: {sorted(set(known) - {'prefixes'})}"
            )
        out[key] = _coerce(f"{name}.{key}", known[key].type, value)
    return out


def _coerce(where: str, annotation: Any, value: Any) -> Any:
    text = str(annotation)
    if value is None and "None" in text:
        return None
    if text.startswith("bool"):
        if not isinstance(value, bool):
            raise ScenarioError(f"{where} must be true or false, got {value!r}")
        return value
    if text.startswith("str"):
        if not isinstance(value, str):
            raise ScenarioError(f"{where} must be a string, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ScenarioError(f"{where} must be a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ScenarioError(f"{where} must be a number, got {value!r}") from None
    if text.startswith("int"):
        if number != int(number):
            raise ScenarioError(f"{where} must be a whole number, got {value!r}")
        return int(number)
    return number


def _prefixes(raw: Any) -> tuple[Prefix, ...]:
    if not isinstance(raw, list):
        raise ScenarioError("prefixes must be a list of {name, tokens, share[, hit_rate]}")
    out = []
    for index, item in enumerate(raw[: MAX_PREFIXES + 1]):
        if not isinstance(item, dict) or not {"tokens", "share"} <= set(item):
            raise ScenarioError(
                f"prefixes[{index}] needs tokens and share (name, hit_rate optional)"
            )
        unknown = set(item) - {"name", "tokens", "share", "hit_rate"}
        if unknown:
            raise ScenarioError(f"prefixes[{index}] has unknown keys {sorted(unknown)}")
        out.append(
            Prefix(
                name=str(item.get("name", f"prefix-{index}")),
                tokens=_coerce(f"prefixes[{index}].tokens", "int", item["tokens"]),
                share=_coerce(f"prefixes[{index}].share", "float", item["share"]),
                hit_rate=_coerce(
                    f"prefixes[{index}].hit_rate", "float | None", item.get("hit_rate")
                ),
            )
        )
    return tuple(out)


def load_yaml(text: str, base: Scenario) -> Scenario:
    """A scenario file over `base`: sections traffic, prefixes, pod, routing, prices, name."""
    if len(text.encode("utf-8")) > MAX_SCENARIO_BYTES:
        raise ScenarioError(f"scenario file is larger than {MAX_SCENARIO_BYTES} bytes")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"scenario file is not valid YAML: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ScenarioError("a scenario file is a mapping of sections")
    unknown = set(raw) - {*_SECTIONS, "prefixes", "name"}
    if unknown:
        raise ScenarioError(
            f"unknown scenario sections {sorted(unknown)}; known: "
            f"{sorted({*_SECTIONS, 'prefixes', 'name'})}"
        )
    changes: dict[str, Any] = {}
    for name, kind in _SECTIONS.items():
        values = _section(kind, name, raw.get(name))
        if name == "traffic" and "prefixes" in raw:
            values["prefixes"] = _prefixes(raw["prefixes"])
        changes[name] = dataclasses.replace(getattr(base, name), **values)
    if "name" in raw:
        changes["name"] = str(raw["name"])
    return dataclasses.replace(base, **changes)
