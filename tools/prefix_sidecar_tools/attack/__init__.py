"""`prefix-sidecar attack`: replay issues 11 and 27's abuse against a real sidecar and judge it.

Socket-level abuse from a hostile local process (random bytes, an HTTP/1.1 request, HTTP/2
rapid reset, a CONTINUATION flood, idle connections that never send a preface), hostile
callers of the HTTP front (a body at the size limit of 4M token ids or of tiny messages, a
chunked body in 2-byte chunks, thousands of idle connections, JSON nested 3,000 deep), and
misbehaving pods (a fast stream, a huge event, no newline, a redirect, a wedge). For each it
reports the sidecar's RSS and fds and another caller's latency before, during and after, and
exits 1 if a verdict fails. `--against http://HOST:PORT` replays the HTTP front's callers
against a running serve instead, another caller's GET /health being the probe. Needs `h2`
(hpack, hyperframe): `pip install 'prefix-sidecar[tools]'`.
"""

from __future__ import annotations

import argparse
import sys

from prefix_sidecar_tools.report import add_command, add_json_option, run_and_report

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    summary = "replay hostile callers and misbehaving pods against a fresh sidecar"
    parser = add_command(subparsers, "attack", summary, __doc__)
    parser.add_argument("--short", action="store_true", help="small counts, seconds (for CI)")
    parser.add_argument("--only", action="append", metavar="SCENARIO", help="only these")
    parser.add_argument(
        "--sidecar-nofile",
        metavar="SOFT[:HARD]",
        help="start the fresh sidecar under this RLIMIT_NOFILE (e.g. 1024, systemd's default)",
    )
    parser.add_argument(
        "--against",
        metavar="URL",
        help="replay only the HTTP front's hostile callers against a running serve's "
        "--openai-listen URL (http://HOST:PORT), probing its /health meanwhile",
    )
    add_json_option(parser)
    parser.set_defaults(func=run)


def print_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        import hpack  # noqa: F401
        import hyperframe  # noqa: F401
    except ModuleNotFoundError:
        print(
            "prefix-sidecar attack needs the h2 package (hpack, hyperframe): "
            "pip install 'prefix-sidecar[tools]'",
            file=sys.stderr,
        )
        return 2
    from prefix_sidecar_tools.attack import runner

    if args.against:
        names = {s.name for s in runner.http_scenarios(args.short)}
        unknown = sorted(set(args.only or ()) - names)
        if unknown or not args.against.startswith("http://"):
            print(f"prefix-sidecar attack --against http://HOST:PORT [--only {sorted(names)}]",
                  file=sys.stderr)  # fmt: skip
            return 2
        report = run_and_report(
            "prefix-sidecar attack",
            runner.run_against(args.against, args.short, args.only, print_progress),
            runner.render_against,
            args.json,
        )
        return 130 if report is None else (0 if report["passed"] else 1)
    names = {s.name for s in runner.scenarios(args.short)}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        print(f"prefix-sidecar attack: unknown scenario(s) {unknown}; one of {sorted(names)}",
              file=sys.stderr)  # fmt: skip
        return 2

    nofile = None
    if args.sidecar_nofile:
        soft, _, hard = args.sidecar_nofile.partition(":")
        nofile = (int(soft), int(hard or soft))
    report = run_and_report(
        "prefix-sidecar attack",
        runner.run(args.short, args.only, print_progress, nofile),
        runner.render,
        args.json,
    )  # fmt: skip
    if report is None:
        return 130
    return 0 if report["passed"] else 1
