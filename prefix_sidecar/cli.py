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
RUNTIME_COMMANDS: dict[str, str] = {
    "serve": "prefix_sidecar.server.cli",
    "kv-indexer": "prefix_sidecar.kv_index.indexer",
    "route": "prefix_sidecar.client_cli",
    "complete": "prefix_sidecar.client_cli",
    "prewarm": "prefix_sidecar.client_cli",
    "backends": "prefix_sidecar.client_cli",
    "prefixes": "prefix_sidecar.client_cli",
    "health": "prefix_sidecar.client_cli",
}
# The tooling (prefix_sidecar_tools, the prefix-sidecar-tools distribution): not needed to
# serve; the `tools` extra installs it.
TOOL_COMMANDS: dict[str, str] = {
    "emulate": "prefix_sidecar_tools.emulator.cli",
    "demo": "prefix_sidecar_tools.demo",
    "bench": "prefix_sidecar_tools.bench.cli",
    "cost": "prefix_sidecar_tools.cost",
    "plan": "prefix_sidecar_tools.plan.cli",
    "fuzz": "prefix_sidecar_tools.fuzz",
    "attack": "prefix_sidecar_tools.attack",
    "inject": "prefix_sidecar_tools.inject",
    "vllm-fleet": "prefix_sidecar_tools.vllm.cli",
}
COMMANDS: dict[str, str] = {**RUNTIME_COMMANDS, **TOOL_COMMANDS}

# A module a tooling verb may miss -> the extra that brings it.
EXTRA_OF_MODULE = {
    "hypothesis": "tools",
    "h2": "tools",
    "hpack": "tools",
    "hyperframe": "tools",
    "uhashring": "tools",
    "matplotlib": "tools",
    "llama_cpp": "real",
    "gguf": "real",
}


def missing_extra_message(command: str, exc: ModuleNotFoundError) -> str | None:
    """What to install when a tooling verb cannot import what it needs, or None if the
    missing module is not one an extra provides (a real bug: let it raise)."""
    top = (exc.name or "").split(".")[0]
    if exc.name is not None and exc.name.startswith("prefix_sidecar_tools"):
        return (
            f"prefix-sidecar: {command!r} is tooling, which this installation lacks "
            "(the runtime alone, like the container image): install the tools extra, "
            "pip install 'prefix-sidecar[tools]'"
        )
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    return (
        f"prefix-sidecar: {command!r} needs {top}, which comes with the {extra!r} extra: "
        f"pip install 'prefix-sidecar[{extra}]'"
    )


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
            message = missing_extra_message(wanted[0], exc) if wanted else None
            if message is not None:
                print(message, file=sys.stderr)
                raise SystemExit(2) from None
            if wanted:
                raise
            continue  # --help: list what this installation can run
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
    try:
        result = func(args)
    except ModuleNotFoundError as exc:  # a tooling verb that imports its extra lazily
        message = missing_extra_message(args.command, exc)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
