"""`prefix-sidecar bench real`: TTFT on real llama.cpp pods, by routing policy.

Generates the tiny GGUF, then for each routing starts a fresh fleet (so every policy
starts with cold caches, RAM cache included), sends the shared workload one request at
a time and prints TTFT and the evaluated/reused prompt tokens read from the pod logs.
A "probe" first measures one pod: a cold ~2,000-token prompt, the same prefix with a
new suffix, and (with --cache-states) a prefix restored from the RAM cache.

Hook for the sidecar: ROUTES maps a name to a RouteFactory, an async context manager
factory that receives the running fleet and yields a RouteFn (request, seq) -> pod URL.
The sidecar policy registers itself with `ROUTES["sidecar"] = factory`, where the
factory starts the sidecar with `fleet.urls` as backends and asks it for a pod.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import aiohttp

from sidecar.realengine.gguf_model import ModelShape, write_model
from sidecar.realengine.pods import LlamaFleet, llama_cpp_available, state_bytes
from sidecar.realengine.workload import (
    RouteFn,
    affinity,
    build_requests,
    prefix_text,
    round_robin,
    run_workload,
    stream_completion,
    suffix_text,
    summarize,
)

RouteFactory = Callable[[LlamaFleet], AbstractAsyncContextManager[RouteFn]]


def _static(make: Callable[[list[str]], RouteFn]) -> RouteFactory:
    @contextlib.asynccontextmanager
    async def factory(fleet: LlamaFleet) -> AsyncIterator[RouteFn]:
        yield make(fleet.urls)

    return factory


ROUTES: dict[str, RouteFactory] = {
    "round-robin": _static(round_robin),
    "affinity": _static(affinity),
}


def register_real(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "real",
        help="TTFT on real llama.cpp pods: round-robin vs prefix affinity (vs the sidecar)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pods", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=3, help="distinct shared prefixes")
    parser.add_argument("--rounds", type=int, default=10, help="requests per prefix")
    parser.add_argument("--prefix-words", type=int, default=2000, help="~tokens per prefix")
    parser.add_argument("--suffix-words", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--cache-states",
        type=int,
        default=0,
        help="give each pod a RAM prompt cache of this many saved request states, an LRU "
        "keyed by prompt (0: a pod keeps only the KV of its last prompt)",
    )
    parser.add_argument(
        "--routes",
        default=",".join(ROUTES),
        help=f"comma-separated routings to compare (known: {', '.join(ROUTES)})",
    )
    parser.add_argument("--model", type=Path, help="GGUF to serve (default: generate one)")
    parser.add_argument("--json", type=Path, help="also write the numbers to this file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not llama_cpp_available():
        print(
            "error: llama-cpp-python[server] is not installed; see docs/real-engine.md",
            file=sys.stderr,
        )
        return 2
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    unknown = [r for r in routes if r not in ROUTES]
    if unknown:
        print(f"error: unknown --routes {unknown}; known: {sorted(ROUTES)}", file=sys.stderr)
        return 2
    if min(args.pods, args.prefixes, args.rounds, args.prefix_words) < 1:
        print(
            "error: --pods, --prefixes, --rounds and --prefix-words must be >= 1", file=sys.stderr
        )
        return 2
    if args.prefix_words + args.suffix_words + args.max_tokens + 16 > ModelShape().context:
        print(
            f"error: --prefix-words too large for the {ModelShape().context}-token context",
            file=sys.stderr,
        )
        return 2
    report = asyncio.run(_bench(args, routes))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


async def _bench(args: argparse.Namespace, routes: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
        model = args.model or write_model(Path(tmp) / "tiny.gguf")
        cache_bytes = args.cache_states * state_bytes(args.prefix_words + 64)
        report: dict[str, Any] = {
            "settings": {k: str(v) for k, v in vars(args).items() if k != "func"}
        }
        async with LlamaFleet(model, n=1, cache_bytes=cache_bytes) as fleet:
            report["probe"] = await _probe(fleet, args)
        _print_probe(report["probe"])
        requests = build_requests(
            args.prefixes,
            args.rounds,
            prefix_words=args.prefix_words,
            suffix_words=args.suffix_words,
        )
        report["routes"] = {}
        for name in routes:
            fleet = LlamaFleet(model, n=args.pods, cache_bytes=cache_bytes)
            async with fleet, ROUTES[name](fleet) as route:
                results = await run_workload(fleet, requests, route, max_tokens=args.max_tokens)
            summary = summarize(results)
            print(summary.line(name))
            report["routes"][name] = {
                "median_ttft_ms": summary.median_ttft_ms,
                "p90_ttft_ms": summary.p90_ttft_ms,
                "evaluated_tokens": summary.evaluated_tokens,
                "reused_tokens": summary.reused_tokens,
                "reuse_ratio": summary.reuse_ratio,
            }
    return report


async def _probe(fleet: LlamaFleet, args: argparse.Namespace) -> dict[str, Any]:
    """One pod: cold prompt, warm prompt (same prefix, new suffix), RAM-cache restore."""
    url, pod = fleet.urls[0], fleet.pods[0]
    a, b = (prefix_text(900 + i, args.prefix_words) for i in range(2))
    steps = [("cold", a + suffix_text(1)), ("warm", a + suffix_text(2))]
    if fleet.cache_bytes:
        steps += [("other prefix", b + suffix_text(3)), ("ram cache", a + suffix_text(4))]
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        for label, prompt in steps:
            mark = pod.log_offset()
            ttft, total, _ = await stream_completion(session, url, prompt, args.max_tokens)
            evals = pod.prompt_evals(mark)
            out[label] = {
                "ttft_ms": ttft,
                "total_ms": total,
                "evaluated": evals[0].evaluated if evals else None,
                "reused": evals[0].reused if evals else None,
                "prompt_eval_ms": evals[0].prompt_eval_ms if evals else None,
            }
    return out


def _print_probe(probe: dict[str, Any]) -> None:
    print("one pod, streaming /v1/completions:")
    for label, row in probe.items():
        print(
            f"  {label:<13} TTFT {row['ttft_ms']:7.1f} ms  total {row['total_ms']:7.1f} ms  "
            f"evaluated {row['evaluated']:>5}  reused {row['reused']:>5}"
        )
