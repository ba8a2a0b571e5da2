"""Fuzz every sidecar.v1.Router RPC with hypothesis: each case must get its documented status.

A case is one request already encoded as raw protobuf bytes, so invalid UTF-8 and random
bytes reach the server exactly as a broken client would send them, plus the statuses that
docs/RELIABILITY.md allows for its RPC and input class. A case passes when its status is in
that set, an error carries a message, and the call ends before its deadline (no hang); every
`probe_every` cases a known-good request must still succeed. The pytest suite and
`prefix-sidecar fuzz --cases N` share these generators, the target and the runner.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

from prefix_sidecar_tools.fuzz.cases import RPCS, over_max_message
from prefix_sidecar_tools.fuzz.runner import Fuzzer
from prefix_sidecar_tools.fuzz.target import FuzzTarget

__all__ = ["RPCS", "FuzzTarget", "Fuzzer", "over_max_message", "register", "run", "split"]

# --- `prefix-sidecar fuzz` -------------------------------------------------------------------

# Share of the cases per RPC: cheap refusals dominate, streaming calls get enough to cover
# every input class. The CI suite uses the same shares for its 10,000 cases.
SHARES = {
    "Route": 0.24,
    "RegisterPrefix": 0.14,
    "UnregisterPrefix": 0.07,
    "ListPrefixes": 0.03,
    "ListBackends": 0.03,
    "Complete": 0.21,
    "Chat": 0.21,
    "Prewarm": 0.07,
}
BATCH = 2000  # hypothesis keeps per-run state: long runs are split into seeded batches


def split(total: int, rpcs: tuple[str, ...] = RPCS) -> dict[str, int]:
    """Cases per RPC for `total` cases (at least one each)."""
    weight = sum(SHARES[r] for r in rpcs)
    return {r: max(1, round(total * SHARES[r] / weight)) for r in rpcs}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fuzz",
        help="fuzz every RPC of a fresh sidecar with hypothesis",
        description="Start an emulator pod and a sidecar, send N generated requests (random "
        "and malformed fields, huge strings, invalid UTF-8, random bytes...), and check each "
        "gets its documented status (docs/RELIABILITY.md). Exits 1 on any undocumented "
        "status, hang or crash.",
    )
    parser.add_argument("--cases", type=int, default=10_000, help="number of cases (10000)")
    parser.add_argument("--seed", type=int, help="hypothesis seed, for a reproducible run")
    parser.add_argument("--rpc", action="append", choices=RPCS, help="only these RPCs")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-call deadline, s (10)")
    parser.add_argument("--probe-every", type=int, default=200, help="good request every N")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.cases < 1 or args.timeout <= 0 or args.probe_every < 1:
        print(
            "prefix-sidecar fuzz: --cases, --timeout and --probe-every must be > 0", file=sys.stderr
        )
        return 2
    rpcs = tuple(args.rpc or RPCS)
    plan = split(args.cases, rpcs)
    started = time.monotonic()
    target = FuzzTarget()
    with target:
        fuzzer = Fuzzer(target, timeout_s=args.timeout, probe_every=args.probe_every)
        for rpc, total in plan.items():
            oversize = max(1, total // 200)  # slow to refuse (see over_max_message)
            for batch, start in enumerate(range(0, total, BATCH)):
                seed = None if args.seed is None else args.seed * 1000 + batch
                try:
                    fuzzer.run(rpc, min(BATCH, total - start), seed=seed)
                    if batch == 0:
                        fuzzer.run(
                            rpc, oversize, seed=seed, strategy=over_max_message(rpc, target.limits)
                        )
                except Exception as exc:
                    # hypothesis raises an ExceptionGroup when it found several distinct bugs
                    found = exc.exceptions if isinstance(exc, ExceptionGroup) else [exc]
                    fuzzer.failures += [f"{rpc}: {error}" for error in found]
                    break
            print(
                f"{rpc}: done ({sum(n for (r, _), n in fuzzer.counts.items() if r == rpc)} cases)",
                file=sys.stderr,
            )
        fuzzer.failures += [f"final check: {p}" for p in fuzzer.health()]
    target.cleanup()
    print(table(fuzzer.counts))
    elapsed = time.monotonic() - started
    print(f"{fuzzer.cases_run} cases in {elapsed:.1f} s, {len(fuzzer.failures)} failure(s)")
    for failure in fuzzer.failures:
        print(f"FAIL {failure}")
    return 1 if fuzzer.failures else 0


def table(counts: collections.Counter[tuple[str, str]]) -> str:
    """Statuses per RPC as a fixed-width table."""
    statuses = sorted({s for _, s in counts}, key=lambda s: (s != "OK", s))
    rows = [["RPC", *statuses, "total"]]
    for rpc in RPCS:
        row = [counts[(rpc, s)] for s in statuses]
        if any(row):
            rows.append([rpc, *map(str, row), str(sum(row))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
