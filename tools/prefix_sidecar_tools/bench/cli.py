"""`prefix-sidecar bench`: one sub-command per benchmark, each registered by its own module.

Like prefix_sidecar/cli.py, the table maps a name to a module exposing `register(bench_subparsers)`.
A module that does not exist (yet) is left out; one that exists but cannot be imported (an
optional dependency missing) or has no `register` still gets a sub-command, which explains
the failure when run, so a broken optional benchmark cannot break the others.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

BENCHMARKS: dict[str, str] = {
    "core": "prefix_sidecar_tools.bench.core",
    "fleet": "prefix_sidecar_tools.bench.fleet",
    "hop": "prefix_sidecar_tools.bench.hop",
    "body": "prefix_sidecar_tools.bench.body",
    "soak": "prefix_sidecar_tools.bench.soak",
    "real": "prefix_sidecar_tools.bench.real",
    "plan-check": "prefix_sidecar_tools.plan.check",
    "organic": "prefix_sidecar_tools.bench.organic",
    "kv-index": "prefix_sidecar_tools.bench.kv_index",
    "tokens": "prefix_sidecar_tools.bench.token_load",
}


def _unavailable(name: str, error: str) -> argparse.ArgumentParser:
    def run(args: argparse.Namespace) -> int:
        print(f"prefix-sidecar bench {name} is not available: {error}", file=sys.stderr)
        return 2

    parser = argparse.ArgumentParser(add_help=False)
    parser.set_defaults(func=run)
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(BENCHMARKS),
        description="Benchmarks; each measures what it compares side by side in one run.",
    )
    bench_subparsers = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    parser.set_defaults(func=lambda args: _print_help(parser))
    for name, module_name in BENCHMARKS.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # any failure: only this benchmark becomes unavailable
            problem = f"{type(exc).__name__}: {exc}"
        else:
            register_benchmark = getattr(module, "register", None)
            if callable(register_benchmark):
                register_benchmark(bench_subparsers)
                continue
            problem = f"{module_name} has no register(bench_subparsers)"
        bench_subparsers.add_parser(
            name, help=f"(unavailable: {problem})", parents=[_unavailable(name, problem)]
        )


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2
