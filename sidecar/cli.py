"""The `prefix-sidecar` command: one sub-command per job, each registered by its own module.

Modules are imported lazily so that `prefix-sidecar cost` does not pay for grpc or aiohttp,
and so that a broken optional part (say, the real-engine bench) cannot break `serve`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# sub-command -> module exposing `register(subparsers) -> None`; the parser it adds
# sets `func=<callable(args) -> int>` as its default.
COMMANDS: dict[str, str] = {
    "serve": "sidecar.server.cli",
    "route": "sidecar.client_cli",
    "complete": "sidecar.client_cli",
    "prewarm": "sidecar.client_cli",
    "backends": "sidecar.client_cli",
    "prefixes": "sidecar.client_cli",
    "health": "sidecar.client_cli",
    "emulate": "sidecar.emulator.cli",
    "demo": "sidecar.demo",
    "bench": "sidecar.bench.cli",
    "cost": "sidecar.cost",
    "inject": "sidecar.inject",
    "fuzz": "sidecar.fuzz",
    "attack": "sidecar.attack",
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefix-sidecar",
        description="Prefix-affinity gRPC sidecar for vLLM fleets.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only import the module that owns the requested command (plus all, for --help).
    wanted = [a for a in argv if not a.startswith("-")][:1]
    modules = {COMMANDS[w] for w in wanted if w in COMMANDS} or set(COMMANDS.values())
    for module_name in sorted(modules):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if wanted and exc.name is not None and module_name.startswith(exc.name):
                raise SystemExit(
                    f"prefix-sidecar: command {wanted[0]!r} is not available: {exc}"
                ) from None
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    args = parser.parse_args(args_list)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    result = func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
