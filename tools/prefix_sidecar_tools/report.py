"""What every bench, the demo, the planner and the attack share: the subcommand itself (its
module docstring as --help), the `--json` option, running the measurement, printing its
table, writing its JSON, and the "targets ... MET" lines."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

Report = dict[str, Any]
TO_STDOUT = "-"


def add_command(
    subparsers: argparse._SubParsersAction, name: str, summary: str, doc: str | None
) -> argparse.ArgumentParser:
    """The `NAME` subcommand: `summary` in the parent's list, `doc` (the module docstring)
    as its --help, laid out as written, since the docstrings are tables and lists."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return parser


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """`--json FILE` writes the report to FILE as well; a bare `--json` prints it to stdout
    instead of the table (progress goes to stderr, so stdout stays parseable)."""
    parser.add_argument(
        "--json",
        nargs="?",
        const=TO_STDOUT,
        metavar="FILE",
        help="also write the report as JSON to FILE (bare --json: to stdout, no table)",
    )


def run_and_report(
    name: str,
    measure: Coroutine[Any, Any, Report] | Callable[[], Report],
    render: Callable[[Report], str],
    json_path: str | None,
) -> Report | None:
    """Run `measure`, print `render(report)` (or the JSON, see add_json_option), write the
    JSON to `json_path`; None if interrupted (what the measurement started is stopped by
    its own context managers)."""
    try:
        report = asyncio.run(measure) if isinstance(measure, Coroutine) else measure()
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted; everything started is stopped.", file=sys.stderr)
        return None
    if json_path == TO_STDOUT:
        json.dump(report, sys.stdout, indent=1, default=str)
        print(flush=True)
        return report
    print(render(report), flush=True)
    if json_path:
        write_json(report, json_path)
        print(f"JSON report written to {json_path}")
    return report


def write_json(report: Report, path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1, default=str)
        handle.write("\n")


def target_lines(targets: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per target: `  NAME: MEASURED - MET` (or NOT MET)."""
    return [
        f"  {target['name']}: {target['measured']} - {'MET' if target['met'] else 'NOT MET'}"
        for target in targets
    ]


def progress_printer(name: str) -> Callable[[str], None]:
    def progress(message: str) -> None:
        print(f"{name}: {message}", file=sys.stderr, flush=True)

    return progress
