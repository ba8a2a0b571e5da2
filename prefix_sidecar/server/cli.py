"""`prefix-sidecar serve`: run the sidecar until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from prefix_sidecar import config as config_module
from prefix_sidecar import logs


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the sidecar on a unix socket",
        description="Run the prefix-affinity gRPC sidecar. Settings come from --config FILE, "
        "then PREFIX_SIDECAR_<FIELD> env vars, then flags.",
    )
    config_module.add_arguments(parser)
    parser.add_argument(
        "--print-config", action="store_true", help="print the merged config as JSON and exit"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_module.from_args(args)
    except config_module.ConfigError as exc:
        print(f"prefix-sidecar: bad config: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(config_module.describe(config), indent=2, default=str))
        return 0
    logs.configure(config.log_level, config.log_format)
    from prefix_sidecar.server.app import serve
    from prefix_sidecar.server.common.unix_socket import SocketPathError

    try:
        asyncio.run(serve(config))
    except (ValueError, SocketPathError, OSError) as exc:
        print(f"prefix-sidecar: cannot start: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0
