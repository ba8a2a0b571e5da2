"""One emulated vLLM pod as a process: `python -m prefix_sidecar_tools.emulator --port P [flags]`.

Prints `READY http://HOST:PORT` on stdout once it listens (EmulatorFleet reads that line,
which also tells it the port when --port is 0). Stops on SIGINT/SIGTERM, and with
--exit-on-stdin-eof also when its parent goes away (the parent holds our stdin open).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from aiohttp.http_exceptions import BadHttpMessage

from prefix_sidecar_tools.emulator.app import run_emulator
from prefix_sidecar_tools.emulator.config import (
    EmulatorConfig,
    add_config_arguments,
    config_from_args,
)
from prefix_sidecar_tools.harness import stop_on_signals


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m prefix_sidecar_tools.emulator",
        description="One emulated vLLM pod (see docs/emulator.md).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (8000)")
    parser.add_argument(
        "--exit-on-stdin-eof",
        action="store_true",
        help="exit when stdin closes (used by EmulatorFleet for child pods)",
    )
    add_config_arguments(parser)
    return parser


async def serve(config: EmulatorConfig, host: str, port: int, exit_on_stdin_eof: bool) -> int:
    loop = asyncio.get_running_loop()
    stop = stop_on_signals()
    watcher: asyncio.BaseTransport | None = None
    if exit_on_stdin_eof:  # our parent holds the other end of stdin: EOF = parent gone
        watcher, _ = await loop.connect_read_pipe(lambda: _EofWatcher(stop), sys.stdin)
    try:
        async with run_emulator(config, port=port, host=host) as url:
            print(f"READY {url}", flush=True)
            await stop.wait()
    except OSError as exc:
        print(f"emulator: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    finally:
        if watcher is not None:
            watcher.close()
    return 0


class _OneLineBadRequests(logging.Filter):
    """A caller that does not speak HTTP/1.1 is logged in one line, not a traceback: SGLang's
    router opens each worker with an HTTP/2 preface first, to see whether it speaks gRPC."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            lines = str(exc.message).strip().splitlines() or [type(exc).__name__]
            reason = lines[0][:80]  # not the bytes it quotes
            record.msg, record.args = f"{record.getMessage()}: {reason}", ()
            record.exc_info = None
        return True


class _EofWatcher(asyncio.Protocol):
    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop.set()


def main(argv: list[str] | None = None) -> int:
    logging.getLogger("aiohttp.server").addFilter(_OneLineBadRequests())
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return asyncio.run(serve(config, args.host, args.port, args.exit_on_stdin_eof))


if __name__ == "__main__":
    sys.exit(main())
