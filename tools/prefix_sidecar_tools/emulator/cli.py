"""`prefix-sidecar emulate`: start N emulated vLLM pods on 127.0.0.1, one process each.

Prints one URL per line, then `PODS url1,url2,...` for scripts; stops every pod on
Ctrl-C/SIGTERM and reports pods that die on their own.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from prefix_sidecar_tools.emulator.config import (
    EmulatorConfig,
    add_config_arguments,
    config_from_args,
)
from prefix_sidecar_tools.emulator.fleet import EmulatorFleet
from prefix_sidecar_tools.harness import stop_on_signals


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "emulate",
        help="run a fleet of emulated vLLM pods",
        description="Start N vLLM-compatible emulated pods on 127.0.0.1 (docs/emulator.md).",
    )
    parser.add_argument("--pods", type=int, default=3, help="number of pods (3)")
    parser.add_argument(
        "--base-port",
        type=int,
        default=8100,
        help="first port; pods use base..base+N-1; 0 = free ports (8100)",
    )
    add_config_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        if args.pods < 1:
            raise ValueError("--pods must be >= 1")
        if args.base_port < 0 or args.base_port + args.pods - 1 > 65535:
            raise ValueError(f"--base-port {args.base_port} with {args.pods} pods leaves 1..65535")
    except ValueError as exc:
        print(f"prefix-sidecar emulate: error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args.pods, config, args.base_port))
    except RuntimeError as exc:
        print(f"prefix-sidecar emulate: {exc}", file=sys.stderr)
        return 1


async def _serve(pods: int, config: EmulatorConfig, base_port: int) -> int:
    stop = stop_on_signals()
    async with EmulatorFleet(pods, config, base_port=base_port) as fleet:
        for url in fleet.urls:
            print(url)
        print("PODS " + ",".join(fleet.urls), flush=True)
        reported: set[int] = set()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                for i in range(len(fleet)):
                    if not fleet.alive(i) and i not in reported:
                        reported.add(i)
                        print(f"pod {i} ({fleet.urls[i]}) exited", file=sys.stderr, flush=True)
        print("stopping pods", file=sys.stderr, flush=True)
    return 0
