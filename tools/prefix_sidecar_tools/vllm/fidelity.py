"""Emulator fidelity: one trace replayed against an emulated pod and a real vLLM pod, side
by side (issue 28).

Why: every fleet-scale figure (hundreds of pods, 60k-token prefixes) comes from the
emulator, so it must behave like vLLM wherever routing reads the pod. The trace is what the
sidecar sends: registered prefixes prewarmed then thin queries, and organic chat sessions,
in a KV cache small enough that the fourth prefix evicts. Each request goes to both pods
(block size 128 on both, the emulator's KV budget scaled so that it holds as many of the
trace's prefixes as vLLM's), and each pod's `cached_tokens` is judged against what a cache
that never evicts would give on that pod's own tokenizer: full, partial, none or cold. The
two tokenizers differ (vLLM's BPE, the emulator's 4 bytes a token), so the outcomes are
compared, not the token counts. Beside them: the /metrics names and labels the sidecar
reads, the prefix-cache counters against the usage, the `endpoint-load-metrics` header in
both formats and on streams, and /tokenize (the trace and the readings: `fidelity_trace`).

    python -m prefix_sidecar_tools.vllm.fidelity [--json FILE]

starts one vLLM pod (the vLLM venv, `make vllm-venv`) and one emulator pod, both on
127.0.0.1, prints the table and stops them. `--url` replays against a running vLLM pod
instead (one sized as `fidelity_pod()` sizes it); give it a new `--key` for each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from prefix_sidecar.membership.load_signals import parse_load_header
from prefix_sidecar_tools.emulator import EmulatorConfig, EmulatorFleet
from prefix_sidecar_tools.emulator.tokenizer import count_tokens
from prefix_sidecar_tools.vllm.fidelity_trace import (
    READ_METRICS,
    SAMPLE,
    PodView,
    Reply,
    Step,
    build_trace,
    observe,
    samples,
    value_of,
)
from prefix_sidecar_tools.vllm.fleet import (
    SERVED_MODEL,
    VllmFleet,
    ensure_tiny_model,
    require_vllm_python,
)
from prefix_sidecar_tools.vllm.tiny_model import VOCAB_SIZE

BLOCK_SIZE = 128  # vLLM's default on CPU
KV_BLOCKS = 64  # the vLLM pod's cache: 8,192 tokens, three of the trace's prefixes
KV_BYTES_PER_TOKEN = 2048  # the tiny model's fp32 KV (2 layers x K,V x 4 heads x 32 x 4)
MAX_MODEL_LEN = 4096
CACHE_LABELS_READ = ("block_size", "num_gpu_blocks", "kv_cache_size_tokens")
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


@dataclass(frozen=True)
class Row:
    """One line of the side-by-side table; `routing`: the sidecar's decisions read it."""

    what: str
    vllm: str
    emulator: str
    routing: bool

    @property
    def same(self) -> bool:
        return self.vllm == self.emulator


def _losses(trace: Sequence[Step], replies: Sequence[Reply]) -> list[str]:
    """Subjects in the order they were first found to have lost blocks."""
    order: list[str] = []
    for step, reply in zip(trace, replies, strict=True):
        if reply.outcome in ("partial", "none") and step.subject not in order:
            order.append(step.subject)
    return order


def _header_shape(value: str | None) -> str:
    return "(none)" if value is None else _NUMBER.sub("N", value)


def _labels(view: PodView, name: str) -> str:
    found = samples(view.metrics_after).get(name)
    if not found:
        return "(missing)"
    if name == "vllm:cache_config_info":
        return ",".join(label for label in CACHE_LABELS_READ if label in found[0])
    return ",".join(sorted(found[0]))


def _counter_check(view: PodView, counter: str, field_name: str) -> str:
    """Does the counter's rise over the replay equal the usage the pod reported?"""
    delta = value_of(view.metrics_after, counter) - value_of(view.metrics_before, counter)
    total = sum(getattr(reply, field_name) for reply in view.replies)
    return "= usage" if delta == total else f"{delta:.0f} (usage {total})"


def _kept(trace: Sequence[Step], replies: Sequence[Reply]) -> str:
    """Of the first prefix found partly evicted, the share of its blocks still cached."""
    for step, reply in zip(trace, replies, strict=True):
        if reply.outcome == "partial":
            return f"{step.subject} {reply.cached / reply.ideal:.2f}"
    return "-"


def _keys(mapping: Any) -> str:
    return ",".join(sorted(mapping)) if isinstance(mapping, dict) else "-"


def compare(trace: Sequence[Step], real: PodView, emulated: PodView, block: int) -> list[Row]:
    """The table: what vLLM and the emulator did, and whether the sidecar's routing reads it
    (the test asserts those rows are the same)."""

    def row(what: str, cell: Any, routing: bool = True) -> Row:
        return Row(what, str(cell(real)), str(cell(emulated)), routing)

    def usage(view: PodView) -> dict[str, Any]:
        return dict(view.answer.get("usage") or {})

    rows = [
        row("cache outcome per request", lambda v: " ".join(r.outcome for r in v.replies)),
        row(f"cached_tokens in whole {block}-token blocks",
            lambda v: all(r.cached % block == 0 for r in v.replies)),
        row("first to lose blocks (LRU)", lambda v: (_losses(trace, v.replies) or ["-"])[0]),
        row("eviction order", lambda v: " ".join(_losses(trace, v.replies)) or "-"),
    ]  # fmt: skip
    for name in READ_METRICS:
        rows.append(row(f"{name} labels", lambda v, name=name: _labels(v, name)))
    for counter, attr in (
        ("vllm:prefix_cache_queries_total", "prompt_tokens"),
        ("vllm:prefix_cache_hits_total", "cached"),
    ):
        rows.append(row(f"{counter} rise", lambda v, c=counter, a=attr: _counter_check(v, c, a)))
    for kind in ("text", "json", "stream"):
        rows.append(row(f"load header ({kind})", lambda v, k=kind: _header_shape(v.headers[k])))
        rows.append(row(f"load header ({kind}) read by the sidecar",
                        lambda v, k=kind: parse_load_header(v.headers[k]) is not None))  # fmt: skip
    rows += [
        row("streamed usage (include_usage), last events", lambda v: v.stream_tail),
        row("/tokenize keys", lambda v: ",".join(v.tokenize_keys)),
        row("prompt tokens of prewarm A (tokenizer)", lambda v: v.replies[0].prompt_tokens, False),
        row("share of blocks kept by the first partly evicted",
            lambda v: _kept(trace, v.replies), False),
        row("vllm:* series names",
            lambda v: len({m for m, _, _ in SAMPLE.findall(v.metrics_after)}), False),
        row("cache_config_info labels",
            lambda v: len(samples(v.metrics_after)["vllm:cache_config_info"][0]), False),
        row("completion keys", lambda v: _keys(v.answer), False),
        row("usage keys", lambda v: _keys(usage(v)), False),
        row("prompt_tokens_details keys",
            lambda v: _keys(usage(v).get("prompt_tokens_details")), False),
    ]  # fmt: skip
    return rows


@dataclass
class Report:
    """The replay on both pods: each request side by side, then the table of checks."""

    block_size: int
    vllm_kv_tokens: int
    emulator_kv_tokens: int
    trace: list[str]
    requests: list[dict[str, Any]] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        rows = [{**asdict(row), "same": row.same} for row in self.rows]
        return {**asdict(self), "rows": rows}

    def table(self) -> str:
        lines = [
            f"block size {self.block_size}; KV: vLLM {self.vllm_kv_tokens:,} tokens, emulator "
            f"{self.emulator_kv_tokens:,} (as many of the trace's prefixes)",
            "",
            f"{'request':<20} {'vLLM prompt':>11} {'cached':>7} {'ideal':>6} {'':<8}"
            f"{'emu prompt':>10} {'cached':>7} {'ideal':>6} {'':<8}",
        ]
        for item in self.requests:
            cells = ""
            for side in ("vllm", "emulator"):
                r = item[side]
                cells += (
                    f"{r['prompt_tokens']:>11} {r['cached']:>7} {r['ideal']:>6} {r['outcome']:<8}"
                )
            lines.append(f"{item['step']:<20}{cells}")
        lines += ["", f"{'what':<50} {'same':<5} {'routing':<8} vLLM | emulator"]
        for row in self.rows:
            flag = "yes" if row.same else "NO"
            lines.append(
                f"{row.what:<50} {flag:<5} {'yes' if row.routing else 'no':<8} "
                f"{row.vllm} | {row.emulator}"
            )
        return "\n".join(lines)


def fidelity_pod(python: Path, startup_timeout: float = 600.0) -> VllmFleet:
    """One vLLM pod of the size the trace is made for (KV_BLOCKS blocks of BLOCK_SIZE); a
    start may take minutes on a busy machine (28-85 s on an idle 2-core one)."""
    return VllmFleet(
        ensure_tiny_model(python),
        1,
        python=python,
        kv_cache_bytes=KV_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        startup_timeout=startup_timeout,
    )


def equivalent_kv_tokens(trace: Sequence[Step], vllm_prompt_tokens: Sequence[int]) -> int:
    """The emulator's budget for the vLLM pod's KV_BLOCKS: scaled by how many more tokens
    the emulator counts in the trace's prefixes, so both hold as many of them."""
    pairs = zip(trace, vllm_prompt_tokens, strict=True)
    prewarms = [(step.body["prompt"], real) for step, real in pairs if step.kind == "prewarm"]
    emulated = sum(count_tokens(text.encode()) for text, _ in prewarms)
    ratio = emulated / sum(real for _, real in prewarms)
    return round(KV_BLOCKS * ratio) * BLOCK_SIZE


def emulator_config(kv_tokens: int, model: str) -> EmulatorConfig:
    return EmulatorConfig(
        model=model,
        block_size=BLOCK_SIZE,
        kv_tokens=kv_tokens,
        max_model_len=MAX_MODEL_LEN * 2,  # its tokenizer counts more tokens for a text
        vocab_size=VOCAB_SIZE,
        time_scale=1000.0,
    )


async def run_fidelity(vllm_url: str, model: str = SERVED_MODEL, key: str = "fidelity") -> Report:
    """Replay the trace against the vLLM pod at `vllm_url`, then against a fresh emulator
    pod (one process, as `prefix-sidecar emulate` starts it) sized to match."""
    trace = build_trace(key)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{vllm_url}/metrics") as resp:
            info = samples(await resp.text())["vllm:cache_config_info"][0]
        block = int(info["block_size"])
        real = await observe(session, vllm_url, model, trace, block)
        kv_tokens = equivalent_kv_tokens(trace, [r.prompt_tokens for r in real.replies])
        async with EmulatorFleet(1, emulator_config(kv_tokens, model)) as fleet:
            emulated = await observe(session, fleet.urls[0], model, trace, block)
    report = Report(block, int(info["num_gpu_blocks"]) * block, kv_tokens, [s.label for s in trace])
    for step, r, e in zip(trace, real.replies, emulated.replies, strict=True):
        report.requests.append(
            {
                "step": step.label,
                "vllm": {**asdict(r), "outcome": r.outcome},
                "emulator": {**asdict(e), "outcome": e.outcome},
            }
        )
    report.rows = compare(trace, real, emulated, block)
    return report


async def _main(args: argparse.Namespace) -> Report:
    if args.url:
        return await run_fidelity(args.url, args.model, args.key)
    async with fidelity_pod(require_vllm_python()) as pod:
        return await run_fidelity(pod.urls[0], pod.model, args.key)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prefix_sidecar_tools.vllm.fidelity", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--url", help="a running vLLM pod (default: start one)")
    parser.add_argument("--model", default=SERVED_MODEL, help="its served model name")
    parser.add_argument("--key", default="fidelity", help="new texts for a new run on one pod")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON")
    args = parser.parse_args(argv)
    report = asyncio.run(_main(args))
    print(report.table())
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
