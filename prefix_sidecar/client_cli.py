"""Client verbs that talk to a running sidecar over its socket: route, complete, prewarm,
backends, prefixes (list/register/unregister) and health (gRPC health from a shell; the
Kubernetes probes are HTTP, /livez and /readyz on the metrics port)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from prefix_sidecar.config import DEFAULT_SOCKET

EXIT_RPC_ERROR = 1


def _socket_target(value: str) -> str:
    if value.startswith(("unix://", "unix:")) or (":" in value and not value.startswith("/")):
        return value
    return "unix://" + os.path.abspath(value)


def _add_socket(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        default=os.environ.get("PREFIX_SIDECAR_SOCKET", DEFAULT_SOCKET),
        help="the sidecar's socket: a path or unix:///path (env PREFIX_SIDECAR_SOCKET)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline in seconds")
    parser.add_argument("--json", action="store_true", help="print JSON")


def register(subparsers: argparse._SubParsersAction) -> None:
    route = subparsers.add_parser("route", help="which pod serves a prefix or prompt")
    _add_socket(route)
    target = route.add_mutually_exclusive_group(required=True)
    target.add_argument("--prefix-id")
    target.add_argument("--prefix-name")
    target.add_argument("--prompt")
    route.set_defaults(func=lambda a: _run(a, _route))

    complete = subparsers.add_parser("complete", help="stream a completion through the sidecar")
    _add_socket(complete)
    prefix = complete.add_mutually_exclusive_group()
    prefix.add_argument("--prefix-id")
    prefix.add_argument("--prefix-name")
    prefix.add_argument("--prefix-file", help="send this file's text as an inline prefix")
    complete.add_argument("input", help="the thin query")
    complete.add_argument("--max-tokens", type=int, default=64)
    complete.add_argument("--temperature", type=float)
    complete.add_argument("--model", default="")
    complete.set_defaults(func=lambda a: _run(a, _complete))

    prewarm = subparsers.add_parser("prewarm", help="prewarm a prefix, showing progress")
    _add_socket(prewarm)
    which = prewarm.add_mutually_exclusive_group(required=True)
    which.add_argument("--prefix-id")
    which.add_argument("--prefix-name")
    prewarm.add_argument("--all", action="store_true", help="every pod, not only the home set")
    prewarm.set_defaults(func=lambda a: _run(a, _prewarm))

    backends = subparsers.add_parser("backends", help="list the pods and their state")
    _add_socket(backends)
    backends.set_defaults(func=lambda a: _run(a, _backends))

    prefixes = subparsers.add_parser("prefixes", help="list, register or unregister prefixes")
    _add_socket(prefixes)
    prefixes.add_argument(
        "action", nargs="?", default="list", choices=("list", "register", "unregister")
    )
    prefixes.add_argument("--name")
    prefixes.add_argument("--id")
    prefixes.add_argument("--file", help="prefix text file, for register")
    prefixes.add_argument("--replicas", type=int, default=0)
    prefixes.add_argument("--prewarm", action="store_true")
    prefixes.set_defaults(func=lambda a: _run(a, _prefixes))

    health = subparsers.add_parser(
        "health", help="exit 0 if the sidecar reports SERVING over gRPC health"
    )
    _add_socket(health)
    health.add_argument("--service", default="", help="service name ('' = whole server)")
    health.set_defaults(func=lambda a: _run(a, _health))


def _run(
    args: argparse.Namespace, verb: Callable[[Any, argparse.Namespace], Awaitable[int]]
) -> int:
    import grpc

    async def main() -> int:
        async with grpc.aio.insecure_channel(_socket_target(args.socket)) as channel:
            return await verb(channel, args)

    try:
        return asyncio.run(main())
    except grpc.aio.AioRpcError as exc:
        print(f"prefix-sidecar: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return EXIT_RPC_ERROR
    except KeyboardInterrupt:
        return 130


def _print(args: argparse.Namespace, message: Any, text: str) -> None:
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(message, preserving_proto_field_name=True)))
    else:
        print(text)


def _backend_line(backend: Any) -> str:
    return (
        f"{backend.url:<32} {backend.state:<8} weight={backend.weight} "
        f"in_flight={backend.in_flight} warm={len(backend.warm_prefixes)} {backend.last_error}"
    )


def _prefix_line(prefix: Any) -> str:
    return (
        f"{prefix.id[:16]}  {prefix.name:<24} {prefix.bytes:>9} bytes  "
        f"replicas={prefix.replicas} backends={','.join(prefix.backends)}"
    )


async def _route(channel: Any, args: argparse.Namespace) -> int:
    from prefix_sidecar.v1 import router_pb2, router_pb2_grpc

    stub = router_pb2_grpc.RouterStub(channel)
    if args.prefix_id:
        request = router_pb2.RouteRequest(prefix_id=args.prefix_id)
    elif args.prefix_name:
        request = router_pb2.RouteRequest(prefix_name=args.prefix_name)
    else:
        request = router_pb2.RouteRequest(prompt=args.prompt)
    reply = await stub.Route(request, timeout=args.timeout)
    _print(
        args,
        reply,
        f"{reply.backend}  branch={reply.branch} key={reply.route_key} "
        f"decision={reply.decision_ns / 1000:.1f}us preference={','.join(reply.preference)}",
    )
    return 0


async def _complete(channel: Any, args: argparse.Namespace) -> int:
    from prefix_sidecar.v1 import router_pb2, router_pb2_grpc

    stub = router_pb2_grpc.RouterStub(channel)
    request = router_pb2.CompleteRequest(
        input=args.input, max_tokens=args.max_tokens, model=args.model
    )
    if args.prefix_id:
        request.prefix_id = args.prefix_id
    elif args.prefix_name:
        request.prefix_name = args.prefix_name
    elif args.prefix_file:
        request.prefix_text = Path(args.prefix_file).read_text(encoding="utf-8")
    if args.temperature is not None:
        request.temperature = args.temperature
    async for chunk in stub.Complete(request, timeout=args.timeout):
        if args.json:
            _print(args, chunk, "")
            continue
        if chunk.backend:
            print(f"[{chunk.backend}] ", end="", file=sys.stderr, flush=True)
        print(chunk.text, end="", flush=True)
        if chunk.HasField("usage"):
            u = chunk.usage
            print(
                f"\n[prompt={u.prompt_tokens} cached={u.cached_tokens} "
                f"completion={u.completion_tokens}]",
                file=sys.stderr,
            )
    if not args.json:
        print()
    return 0


async def _prewarm(channel: Any, args: argparse.Namespace) -> int:
    from prefix_sidecar.v1 import router_pb2, router_pb2_grpc

    stub = router_pb2_grpc.RouterStub(channel)
    request = router_pb2.PrewarmRequest(all_backends=args.all)
    if args.prefix_id:
        request.prefix_id = args.prefix_id
    else:
        request.prefix_name = args.prefix_name
    failed = 0
    async for event in stub.Prewarm(request, timeout=args.timeout):
        state = router_pb2.PrewarmEvent.State.Name(event.state)
        failed += state == "FAILED"
        detail = (
            f"prompt={event.prompt_tokens} cached={event.cached_tokens} {event.elapsed_ms:.0f} ms"
            if state == "WARMED"
            else event.error
        )
        _print(args, event, f"{event.backend:<32} {state:<9} attempt {event.attempt} {detail}")
    return 1 if failed else 0


async def _backends(channel: Any, args: argparse.Namespace) -> int:
    from prefix_sidecar.v1 import router_pb2, router_pb2_grpc

    reply = await router_pb2_grpc.RouterStub(channel).ListBackends(
        router_pb2.ListBackendsRequest(), timeout=args.timeout
    )
    _print(args, reply, "\n".join(map(_backend_line, reply.backends)) or "(no backends)")
    return 0


async def _prefixes(channel: Any, args: argparse.Namespace) -> int:
    from prefix_sidecar.v1 import router_pb2, router_pb2_grpc

    stub = router_pb2_grpc.RouterStub(channel)
    if args.action == "register":
        if not (args.name and args.file):
            raise SystemExit("prefix-sidecar prefixes register needs --name and --file")
        text = Path(args.file).read_text(encoding="utf-8")
        reply = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(
                name=args.name, text=text, replicas=args.replicas, prewarm=args.prewarm
            ),
            timeout=args.timeout,
        )
        _print(
            args,
            reply,
            f"{reply.id}  {reply.name}  {reply.bytes} bytes  backends={','.join(reply.backends)}",
        )
        return 0
    if args.action == "unregister":
        request = (
            router_pb2.UnregisterPrefixRequest(prefix_id=args.id)
            if args.id
            else router_pb2.UnregisterPrefixRequest(prefix_name=args.name or "")
        )
        removed = await stub.UnregisterPrefix(request, timeout=args.timeout)
        _print(args, removed, "\n".join(removed.removed_ids))
        return 0
    listing = await stub.ListPrefixes(router_pb2.ListPrefixesRequest(), timeout=args.timeout)
    _print(args, listing, "\n".join(map(_prefix_line, listing.prefixes)) or "(no prefixes)")
    return 0


async def _health(channel: Any, args: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
    )
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
