"""`prefix-sidecar bench real`: the sidecar against other routers on real engine pods.

  --engine llamacpp (the default)  llama.cpp pods (llama-cpp-python, a generated GGUF): one
      request at a time, round-robin vs affinity vs the sidecar; TTFT and the prompt tokens
      the pods' logs say they reused (prefix_sidecar_tools.bench.real_llamacpp)
  --engine vllm  real vLLM pods (the vLLM venv of `make vllm-venv`, the tiny model): the
      sidecar (a `prefix-sidecar serve` process, prefixes registered and prewarmed, requests
      through its HTTP front) vs round-robin and least-loaded straight to the pods vs SGLang's
      router with --policy cache_aware (`pip install sglang-router`), on two workloads:
      registered mega-sale prefixes (4k-16k tokens, Poisson, Zipf; pods' KV too small for
      all of them) and `bench organic`'s trace. The pods are made cold between systems. Per
      system: hit rate from vLLM's own counters and from each answer's cached_tokens, the
      whole-block ceiling, TTFT p50/p99 (streamed, first chunk), requests per pod, errors,
      yuan per day by docs/mission.md's model (prefix_sidecar_tools.bench.real_vllm)

    prefix-sidecar bench real --engine vllm --pods 4 --json real-vllm.json

Latency is only meaningful with one pod per core (--pods 2 on a 2-core machine): two busy
pods on one core freeze each other for seconds. Hit rates and placement need more pods.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prefix_sidecar_tools.bench.argtypes import (
    non_negative,
    non_negative_int,
    positive_float,
    positive_int,
)
from prefix_sidecar_tools.report import add_command, progress_printer

ENGINES = ("llamacpp", "vllm")
SUMMARY = "real engine pods (llama.cpp, vLLM): the sidecar vs round-robin, least-loaded, SGLang"
# Flags both engines have, whose defaults differ: {flag: (llama.cpp, vLLM)}.
SHARED_DEFAULTS = {"pods": (4, 4), "prefixes": (4, 8), "max_tokens": (4, 4)}


def register_real(bench_subparsers: argparse._SubParsersAction) -> None:
    from prefix_sidecar_tools.bench.real_llamacpp import PLACEMENTS, ROUTES

    parser = add_command(bench_subparsers, "real", SUMMARY, __doc__)
    parser.add_argument("--engine", choices=ENGINES, default="llamacpp")
    parser.add_argument("--pods", type=positive_int, help="pods in the fleet (4)")
    parser.add_argument(
        "--prefixes", type=positive_int, help="distinct prefixes (llama.cpp 4, vLLM 8)"
    )
    parser.add_argument("--max-tokens", type=positive_int, help="tokens per answer (4)")
    parser.add_argument("--json", type=Path, help="also write the numbers to this file")
    llama = parser.add_argument_group("--engine llamacpp")
    llama.add_argument("--rounds", type=positive_int, default=25, help="requests per prefix")
    llama.add_argument("--prefix-words", type=positive_int, default=2000, help="~tokens per prefix")
    llama.add_argument("--suffix-words", type=positive_int, default=16)
    llama.add_argument(
        "--cache-states",
        type=non_negative_int,
        default=0,
        help="give each pod a RAM prompt cache of this many saved request states, an LRU "
        "keyed by prompt (0: a pod keeps only the KV of its last prompt)",
    )
    llama.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="distinct",
        help="distinct: prefix texts with different home pods (needs --prefixes <= --pods); "
        "hashed: the first texts, wherever they hash",
    )
    llama.add_argument(
        "--routes",
        default=",".join(ROUTES),
        help=f"comma-separated routings to compare (known: {', '.join(ROUTES)})",
    )
    llama.add_argument("--model", type=Path, help="GGUF to serve (default: generate one)")
    _vllm_flags(parser.add_argument_group("--engine vllm"))
    parser.set_defaults(func=run)


def _vllm_flags(group: argparse._ArgumentGroup) -> None:
    from prefix_sidecar_tools.bench.real_systems import SYSTEMS, default_systems
    from prefix_sidecar_tools.bench.real_vllm import COLD, WORKLOADS

    group.add_argument(
        "--systems",
        default=",".join(default_systems()),
        help=f"comma-separated systems (known: {', '.join(SYSTEMS)}; sglang when installed)",
    )
    group.add_argument("--workloads", default=",".join(WORKLOADS), help="registered,organic")
    group.add_argument("--requests", type=positive_int, default=120, help="mega-sale requests")
    group.add_argument(
        "--rate", type=positive_float, default=3.0, help="mega-sale requests/s, Poisson"
    )
    group.add_argument("--zipf", type=non_negative, default=1.0, help="Zipf exponent over prefixes")
    group.add_argument("--min-prefix-tokens", type=positive_int, default=4096)
    group.add_argument("--max-prefix-tokens", type=positive_int, default=16384)
    group.add_argument(
        "--kv-share",
        type=positive_float,
        default=0.6,
        help="each pod's KV cache as a share of all the prefixes' tokens (0.6: below 1, so "
        "they do not all fit in one pod)",
    )
    group.add_argument(
        "--kv-tokens", type=non_negative_int, default=0, help="each pod's KV, overrides"
    )
    group.add_argument(
        "--organic-duration", type=positive_float, default=20.0, help="seconds of organic arrivals"
    )
    group.add_argument(
        "--organic-rate", type=positive_float, default=4.0, help="organic flows started per second"
    )
    group.add_argument(
        "--cold",
        choices=COLD,
        default="restart",
        help="how the pods are made cold between systems: restart them (honest, ~30-80 s), "
        "or POST /reset_prefix_cache (vLLM's dev mode, seconds)",
    )
    group.add_argument(
        "--timeout", type=positive_float, default=60.0, help="first-token timeout, s"
    )
    group.add_argument(
        "--startup-timeout",
        type=positive_float,
        default=600.0,
        help="seconds a pod may take to answer /health (28-85 s on a quiet 2-core box, "
        "over 240 s on a busy one)",
    )
    group.add_argument(
        "--pods-nice",
        type=pod_niceness,
        default=0,
        help="run every pod at this CPU niceness (1-19; 0: as the routers), for every system "
        "alike: where CPU pods share the cores with the routers, a router's decision "
        "otherwise waits in the run queue behind their prefill (docs/real-engine.md)",
    )
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--sidecar-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more setting for every sidecar system, as serve's --set (repeatable)",
    )


register = register_real  # the name prefix_sidecar_tools/bench/cli.py looks for


def pod_niceness(text: str) -> int:
    # Imported here: the CLI loads every bench at startup, and pod code only when it runs.
    from prefix_sidecar_tools.vllm.pod import MAX_NICENESS

    value = non_negative_int(text)
    if value > MAX_NICENESS:
        raise argparse.ArgumentTypeError(f"{value}: a niceness is 0 to {MAX_NICENESS}")
    return value


def run(args: argparse.Namespace) -> int:
    index = ENGINES.index(args.engine)
    for flag, defaults in SHARED_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, defaults[index])
    if args.engine == "llamacpp":
        from prefix_sidecar_tools.bench.real_llamacpp import run_llamacpp

        return run_llamacpp(args)
    return run_vllm(args)


def run_vllm(args: argparse.Namespace) -> int:
    import asyncio

    from prefix_sidecar_tools.bench.real_report import render
    from prefix_sidecar_tools.bench.real_systems import SYSTEMS
    from prefix_sidecar_tools.bench.real_vllm import WORKLOADS, bench_vllm
    from prefix_sidecar_tools.vllm.fleet import VllmUnavailable

    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    unknown += [w for w in args.workloads if w not in WORKLOADS]
    if unknown or not args.systems or not args.workloads:
        print(f"error: unknown or no --systems/--workloads: {unknown}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(bench_vllm(args, progress_printer("bench real")))
    except VllmUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nbench real: interrupted; everything started is stopped.", file=sys.stderr)
        return 130
    print(render(report))
    if args.json:
        report["settings"] = {k: str(v) for k, v in report["settings"].items()}
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0
