"""`prefix-sidecar bench body`: what reading a caller's body costs the HTTP front, json.loads
against the front's step reader, side by side in one run.

Each reader reads each body shape in a fresh child process (so the peak memory it reports
is its own), `--repeat` times; the figures are the medians:
- json.loads: body.parse_request without a prefix store, which reads the whole body with
  one json.loads and its fields in one go: one step of the loop, whatever the size (what
  the front did before it read large bodies in steps);
- front: body_steps.read_request as the front calls it (with a prefix store): a body up to
  SYNC_BYTES, or one that is mostly its route string, is read by body.py (the string cut
  out where it lies, json.loads on the rest); any other by ijson, a slice per step;
- ijson: body_steps.read_in_steps, ijson's push parser on the whole body, whatever its shape.
Columns: total ms of the reading thread's CPU (the box's other load is not counted); the
longest step of the event loop, in CPU ms, seen by a task that wakes every turn (as the
hostile-caller tests watch it); the peak resident memory the read added (MiB, Linux).
Shapes: the hostile ones of the front's tests (4M token ids in 8 MiB; 270k chat messages),
the 60k-token prompt of `bench hop` (240 KB), a small body, and a 7 MiB string in a field
routing does not read (a long token: yajl's slice grows to hold it).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.server.openai.body import FrontRequest, parse_request
from prefix_sidecar.server.openai.body_steps import read_in_steps, read_request
from prefix_sidecar_tools.report import add_command, add_json_option, run_and_report
from prefix_sidecar_tools.workload.texts import rules_text

SUMMARY = "reading a caller's body: json.loads against the HTTP front's step reader (ijson)"
READERS = ("json.loads", "front", "ijson")
WINDOW = 4096  # the router's route_window_bytes default


def _token_ids(scale: float) -> bytes:
    rng = random.Random(7)
    ids = b",".join(b"%d" % rng.randrange(10) for _ in range(int(4_000_000 * scale)))
    return b'{"model": "m", "max_tokens": 1, "prompt": [' + ids + b"]}"


def _messages(scale: float) -> bytes:
    turns = [
        {"role": "user" if i % 9 else "assistant", "content": "h"}
        for i in range(int(270_000 * scale))
    ]
    return json.dumps({"model": "m", "messages": turns}, separators=(",", ":")).encode()


def _long_prompt(scale: float) -> bytes:
    return json.dumps({"model": "m", "prompt": rules_text(60_000), "stream": True}).encode()


def _small(scale: float) -> bytes:
    return b'{"model": "m", "prompt": "Is a 499 yuan offer compliant?", "max_tokens": 16}'


def _long_string_elsewhere(scale: float) -> bytes:
    text = "a long tool result, " * int(360_000 * scale)
    return json.dumps({"model": "m", "prompt": "p", "metadata": {"log": text}}).encode()


# name -> (chat, the body at a scale)
SHAPES: dict[str, tuple[bool, Callable[[float], bytes]]] = {
    "4M token ids": (False, _token_ids),
    "270k messages": (True, _messages),
    "240 KB prompt": (False, _long_prompt),
    "small body": (False, _small),
    "7 MiB other string": (False, _long_string_elsewhere),
}


async def _read(reader: str, raw: bytes, chat: bool) -> FrontRequest:
    if reader == "json.loads":
        return parse_request(raw, chat=chat)
    if reader == "front":
        return await read_request(raw, chat=chat, store=PrefixStore(), window=WINDOW, turns=True)
    return await read_in_steps(raw, chat, WINDOW + 1)


async def _timed(reader: str, raw: bytes, chat: bool) -> tuple[float, float]:
    """(total CPU ms of the read, the loop's longest step meanwhile in CPU ms)."""
    longest = 0.0

    async def watch() -> None:
        nonlocal longest
        while True:
            started = time.thread_time()
            await asyncio.sleep(0)
            longest = max(longest, time.thread_time() - started)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0)
    started = time.thread_time()
    await _read(reader, raw, chat)
    total = time.thread_time() - started
    await asyncio.sleep(0)  # the watcher sees the last step
    watcher.cancel()
    return total * 1e3, longest * 1e3


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def measure_one(shape: str, reader: str, repeat: int, scale: float) -> dict[str, Any]:
    """One reader on one shape, in this process (a child of `measure`)."""
    chat, make = SHAPES[shape]
    raw = make(scale)
    gc.collect()
    try:  # reset the peak resident set to the current one (Linux)
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")
        before = _status_kb("VmRSS")
    except OSError:
        before = None
    runs = [asyncio.run(_timed(reader, raw, chat))]
    peak = _status_kb("VmHWM")
    runs += [asyncio.run(_timed(reader, raw, chat)) for _ in range(repeat - 1)]
    return {
        "shape": shape,
        "reader": reader,
        "bytes": len(raw),
        "total_ms": statistics.median(total for total, _ in runs),
        "longest_step_ms": statistics.median(step for _, step in runs),
        "peak_mib": (peak - before) / 1024 if peak is not None and before is not None else None,
    }


def measure(repeat: int, scale: float) -> dict[str, Any]:
    rows = []
    for shape in SHAPES:
        for reader in READERS:
            print(f"bench body: {shape}, {reader}", file=sys.stderr, flush=True)
            argv = [sys.executable, "-m", __name__, shape, reader, str(repeat), str(scale)]
            done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300)
            rows.append(json.loads(done.stdout))
    return {"params": {"repeat": repeat, "scale": scale}, "rows": rows}


def render(report: dict[str, Any]) -> str:
    params = report["params"]
    lines = [
        f"bench body: medians of {params['repeat']} reads, CPU time (scale {params['scale']})",
        f"{'shape':<20} {'MB':>6}  {'reader':<10} {'total ms':>9} {'longest step ms':>16}"
        f" {'peak MiB':>9}",
    ]
    for row in report["rows"]:
        peak = "-" if row["peak_mib"] is None else f"{row['peak_mib']:.1f}"
        lines.append(
            f"{row['shape']:<20} {row['bytes'] / 1e6:>6.2f}  {row['reader']:<10}"
            f" {row['total_ms']:>9.1f} {row['longest_step_ms']:>16.1f} {peak:>9}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    measured = run_and_report(
        "bench body", lambda: measure(args.repeat, args.scale), render, args.json
    )
    return 0 if measured is not None else 130


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(bench_subparsers, "body", SUMMARY, __doc__)
    parser.add_argument("--repeat", type=int, default=3, help="reads per reader and shape")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="size of the large shapes (1: as the tests')"
    )
    add_json_option(parser)
    parser.set_defaults(func=run)


if __name__ == "__main__":
    print(json.dumps(measure_one(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))))
