"""Run a benchmark coroutine, print its report, write its JSON: the tail every bench shares."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any


def run_and_report(
    name: str,
    measure: Coroutine[Any, Any, dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    json_path: str | None,
) -> dict[str, Any] | None:
    """Run `measure`, print `render(report)`, write it to `json_path`; None if interrupted
    (everything the bench started is stopped by its own context managers)."""
    try:
        report = asyncio.run(measure)
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted; everything started is stopped.", file=sys.stderr)
        return None
    print(render(report))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
            handle.write("\n")
        print(f"JSON report written to {json_path}")
    return report


def progress_printer(name: str) -> Callable[[str], None]:
    def progress(message: str) -> None:
        print(f"{name}: {message}", file=sys.stderr, flush=True)

    return progress
