"""`prefix-sidecar bench real --engine llamacpp`: TTFT on real llama.cpp pods, by routing.

Generates the tiny GGUF, probes one pod (a cold ~2,000-token prompt, the same prefix with
a new suffix and, with --cache-states, a prefix restored from the RAM cache), then starts
one fleet and runs the same workload once per routing, one request at a time, restarting
the pods between routings (same URLs, every cache cold):

  round-robin  straight to pod seq mod N
  affinity     straight to pod (prefix index mod N): the oracle placement, no sidecar
  sidecar      a real Sidecar in front of the pods (health path /v1/models): each prefix
               registered with prewarm, each request a Complete RPC (prefix id + suffix),
               TTFT timed at the gRPC client, the pod read from the first chunk

For each it prints TTFT p50/p99, the prompt tokens the pods evaluated and reused (whole
pod logs, the sidecar's prewarm included), the hit rate reused/(evaluated+reused), and
docs/mission.md's cost per day at that hit rate (`prefix_sidecar_tools.cost.daily_cost`).

Placement (--placement): a llama.cpp pod keeps one prompt's KV, so by default the
prefix texts are chosen to have distinct home pods under the routing contract
("distinct", needs --prefixes <= --pods); "hashed" takes the first texts as they hash,
where two prefixes may share a pod (give --cache-states to hold both).

Hook: ROUTES maps a name to a RouteFactory(fleet, requests, max_tokens), an async context
manager that yields a SendFn(request, seq) -> Served (see prefix_sidecar_tools.realengine.workload).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import aiohttp

from prefix_sidecar_tools.cost import CostParams, daily_cost
from prefix_sidecar_tools.realengine.gguf_model import ModelShape, write_model
from prefix_sidecar_tools.realengine.pods import (
    LlamaFleet,
    PromptEval,
    llama_cpp_available,
    state_bytes,
)
from prefix_sidecar_tools.realengine.workload import (
    Request,
    Result,
    RouteFn,
    SendFn,
    affinity,
    build_requests,
    direct,
    prefix_text,
    round_robin,
    run_workload,
    stream_completion,
    suffix_text,
    summarize,
)

RouteFactory = Callable[[LlamaFleet, Sequence[Request], int], AbstractAsyncContextManager[SendFn]]


def _direct(make: Callable[[list[str]], RouteFn]) -> RouteFactory:
    @contextlib.asynccontextmanager
    async def factory(
        fleet: LlamaFleet, requests: Sequence[Request], max_tokens: int
    ) -> AsyncIterator[SendFn]:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            yield direct(make(fleet.urls), session, max_tokens)

    return factory


@contextlib.asynccontextmanager
async def _via_sidecar(
    fleet: LlamaFleet, requests: Sequence[Request], max_tokens: int
) -> AsyncIterator[SendFn]:
    from prefix_sidecar_tools.realengine.via_sidecar import (
        ViaSidecar,  # grpc and the server: only here
    )

    async with ViaSidecar(fleet, workload_prefixes(requests), max_tokens=max_tokens) as via:
        yield via.send


ROUTES: dict[str, RouteFactory] = {
    "round-robin": _direct(round_robin),
    "affinity": _direct(affinity),
    "sidecar": _via_sidecar,
}
PLACEMENTS = ("distinct", "hashed")


def home_counts(urls: Sequence[str], texts: Sequence[str]) -> list[int]:
    """How many of the prefixes each pod is home for (routing contract v1), most first."""
    from prefix_sidecar_tools.realengine.via_sidecar import contract_homes

    owners = [home[0] for home in contract_homes(urls, texts)]
    return sorted((owners.count(url) for url in urls), reverse=True)


def workload_prefixes(requests: Sequence[Request]) -> list[str]:
    """The text of each workload prefix, by index (Request.prefix_id)."""
    texts: dict[int, str] = {}
    for request in requests:
        texts.setdefault(request.prefix_id, request.prefix)
    return [texts[i] for i in sorted(texts)]


def run_llamacpp(args: argparse.Namespace) -> int:
    """The llama.cpp bench of `bench real` (its flags: prefix_sidecar_tools.bench.real)."""
    if not llama_cpp_available():
        print(
            "error: llama-cpp-python[server] is not installed; see docs/real-engine.md",
            file=sys.stderr,
        )
        return 2
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    unknown = [r for r in routes if r not in ROUTES]
    if unknown:
        print(f"error: unknown --routes {unknown}; known: {sorted(ROUTES)}", file=sys.stderr)
        return 2
    if args.placement == "distinct" and args.prefixes > args.pods:
        print(
            f"error: --placement distinct needs --prefixes <= --pods ({args.prefixes} > "
            f"{args.pods}); use --placement hashed with --cache-states to share pods",
            file=sys.stderr,
        )
        return 2
    if args.prefix_words + args.suffix_words + args.max_tokens + 16 > ModelShape().context:
        print(
            f"error: --prefix-words too large for the {ModelShape().context}-token context",
            file=sys.stderr,
        )
        return 2
    report = asyncio.run(_bench(args, routes))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


async def _bench(args: argparse.Namespace, routes: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
        model = args.model or write_model(Path(tmp) / "tiny.gguf")
        cache_bytes = args.cache_states * state_bytes(args.prefix_words + 64)
        report: dict[str, Any] = {
            "settings": {k: str(v) for k, v in vars(args).items() if k != "func"}
        }
        async with LlamaFleet(model, n=1, cache_bytes=cache_bytes) as fleet:
            report["probe"] = await _probe(fleet, args)
        _print_probe(report["probe"])
        report["routes"] = {}
        async with LlamaFleet(model, n=args.pods, cache_bytes=cache_bytes) as fleet:
            numbers = None
            if args.placement == "distinct":
                from prefix_sidecar_tools.realengine.via_sidecar import distinct_home_numbers

                numbers = distinct_home_numbers(fleet.urls, args.prefixes, words=args.prefix_words)
            requests = build_requests(
                args.prefixes,
                args.rounds,
                prefix_words=args.prefix_words,
                suffix_words=args.suffix_words,
                prefix_numbers=numbers,
            )
            homes = home_counts(fleet.urls, workload_prefixes(requests))
            report["prefixes_per_pod"] = homes
            print(
                f"\n{args.pods} pods, {args.prefixes} prefixes ({args.placement} placement, "
                f"texts {numbers or list(range(args.prefixes))}; prefixes per pod by the "
                f"routing contract {homes}), {len(requests)} requests per routing, cache "
                f"states per pod {args.cache_states}"
            )
            for index, name in enumerate(routes):
                if index:
                    await fleet.restart()  # same URLs, cold caches, fresh logs
                async with ROUTES[name](fleet, requests, args.max_tokens) as send:
                    results = await run_workload(
                        fleet, requests, send=send, max_tokens=args.max_tokens
                    )
                report["routes"][name] = route_report(results, fleet.prompt_evals())
        _print_table(report["routes"])
    return report


def route_report(results: Sequence[Result], logs: dict[str, list[PromptEval]]) -> dict[str, Any]:
    """TTFT from the client's side; tokens from the whole pod logs (prewarm included)."""
    summary = summarize(results)
    records = [record for pod in logs.values() for record in pod]
    evaluated = sum(r.evaluated for r in records)
    reused = sum(r.reused for r in records)
    hit_rate = reused / (evaluated + reused) if evaluated + reused else 0.0
    cost = daily_cost(CostParams(), hit_rate)
    return {
        "requests": summary.requests,
        "p50_ttft_ms": summary.median_ttft_ms,
        "p90_ttft_ms": summary.p90_ttft_ms,
        "p99_ttft_ms": summary.p99_ttft_ms,
        "pod_records": len(records),
        "evaluated_tokens": evaluated,
        "reused_tokens": reused,
        "hit_rate": hit_rate,
        "cost_raw_per_day": cost.raw,
        "cost_per_day": cost.cached,
        "saving_pct": cost.saving_pct,
    }


def _print_table(rows: dict[str, dict[str, Any]]) -> None:
    params = CostParams()
    print(
        f"\ncost per day by docs/mission.md's model ({params.requests_per_day:,.0f} requests, "
        f"{params.prefix_tokens:,.0f}-token prefix, {params.price_base:g}/"
        f"{params.price_cache:g}/{params.price_out:g} yuan per M tokens) at the measured hit "
        f"rate; without any cache {daily_cost(params, 0.0).raw:,.0f} yuan/day"
    )
    header = (
        f"{'routing':<12} {'n':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'evaluated':>10} "
        f"{'reused':>8} {'hit rate':>8} {'yuan/day':>10} {'saved':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        print(
            f"{name:<12} {row['requests']:>4} {row['p50_ttft_ms']:>6.1f} ms "
            f"{row['p99_ttft_ms']:>6.1f} ms {row['evaluated_tokens']:>10,} "
            f"{row['reused_tokens']:>8,} {row['hit_rate']:>8.1%} "
            f"{row['cost_per_day']:>10,.0f} {row['saving_pct']:>5.1f}%"
        )
    if "round-robin" in rows and "sidecar" in rows:
        ratio = rows["round-robin"]["p50_ttft_ms"] / rows["sidecar"]["p50_ttft_ms"]
        print(f"sidecar vs round-robin: TTFT p50 {ratio:.1f}x lower")


async def _probe(fleet: LlamaFleet, args: argparse.Namespace) -> dict[str, Any]:
    """One pod: cold prompt, warm prompt (same prefix, new suffix), RAM-cache restore."""
    url, pod = fleet.urls[0], fleet.pods[0]
    a, b = (prefix_text(900 + i, args.prefix_words) for i in range(2))
    steps = [("cold", a + suffix_text(1)), ("warm", a + suffix_text(2))]
    if fleet.cache_bytes:
        steps += [("other prefix", b + suffix_text(3)), ("ram cache", a + suffix_text(4))]
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        for label, prompt in steps:
            mark = pod.log_offset()
            ttft, total, _ = await stream_completion(session, url, prompt, args.max_tokens)
            evals = pod.prompt_evals(mark)
            out[label] = {
                "ttft_ms": ttft,
                "total_ms": total,
                "evaluated": evals[0].evaluated if evals else None,
                "reused": evals[0].reused if evals else None,
                "prompt_eval_ms": evals[0].prompt_eval_ms if evals else None,
            }
    return out


def _print_probe(probe: dict[str, Any]) -> None:
    print("one pod, streaming /v1/completions:")
    for label, row in probe.items():
        print(
            f"  {label:<13} TTFT {row['ttft_ms']:7.1f} ms  total {row['total_ms']:7.1f} ms  "
            f"evaluated {row['evaluated']:>5}  reused {row['reused']:>5}"
        )
