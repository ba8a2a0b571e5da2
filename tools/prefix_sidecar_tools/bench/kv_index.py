"""`prefix-sidecar bench kv-index`: the shared block index's costs in Redis, in one run.

A throwaway redis-server on 127.0.0.1 (or --redis URL, which this writes to: give it an
empty one), then:
- write: `--blocks` blocks stored by `--pods` pods (each block on `--replicas` of them),
  through the indexer's writer (prefix_sidecar/kv_index/writer.py), as vLLM's BlockStored
  events of 32 blocks: commands a second, and Redis's used_memory per million
  (block, pod) fields;
- lookup: a sidecar's query (lookup.py) for chains of 1 to 256 sampled blocks, interleaved
  with a bare PING round trip over the same connection (the floor): p50 and p99 of each,
  one at a time;
- decision: precise routing's step on the index (kv_index/lookup.py) for a prompt of that
  many blocks' token ids: its keys made, at the pods' block size, and looked up.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from prefix_sidecar.kv_events.block_keys import PromptKeys, chain
from prefix_sidecar.kv_events.decode import BlockStored
from prefix_sidecar.kv_index.lookup import IndexLookup
from prefix_sidecar.kv_index.writer import IndexWriter
from prefix_sidecar_tools.percentile import percentile
from prefix_sidecar_tools.redis_server import RedisServer
from prefix_sidecar_tools.report import Report, add_command, add_json_option, run_and_report

BLOCK = 16
EVENT_BLOCKS = 32
CHAINS = (1, 16, 64, 256)


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(bench_subparsers, "kv-index", "the shared block index in Redis", __doc__)
    parser.add_argument("--redis", default="", help="an empty Redis to use (default: start one)")
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--lookups", type=int, default=300, help="per chain length")
    parser.add_argument("--seed", type=int, default=0)
    add_json_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = run_and_report("bench kv-index", measure(args), render, args.json)
    return 0 if report is not None else 130


async def measure(args: argparse.Namespace) -> Report:
    if args.redis:
        return await _measure(args.redis, args)
    with tempfile.TemporaryDirectory() as workdir:
        server = RedisServer(Path(workdir))
        await server.start()
        try:
            return await _measure(server.url, args)
        finally:
            server.kill()


async def _measure(url: str, args: argparse.Namespace) -> Report:
    rng = random.Random(args.seed)
    redis = Redis.from_url(url, socket_timeout=5)
    try:
        before = int((await redis.info("memory"))["used_memory"])
        write = await _write(redis, args, rng)
        after = int((await redis.info("memory"))["used_memory"])
        fields = args.blocks * args.replicas
        write["bytes_per_million_fields"] = (after - before) / fields * 1e6
        lookup = await _lookups(redis, write.pop("prompts"), args.lookups)
    finally:
        await redis.aclose()
    return {"config": vars(args) | {"redis": url}, "write": write, "lookup": lookup}


async def _write(redis: Redis, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    writer = IndexWriter(redis)
    pods = [f"http://10.0.{n // 250}.{n % 250}:8000" for n in range(args.pods)]
    for pod in pods:
        writer.reset(pod, known=True)
    task = asyncio.create_task(writer.run())
    prompts: list[tuple[int, ...]] = []
    started = time.perf_counter()
    next_hash = 1
    for first in range(0, args.blocks, EVENT_BLOCKS):
        count = min(EVENT_BLOCKS, args.blocks - first)
        tokens = tuple(rng.randrange(32_000) for _ in range(count * BLOCK))
        hashes = tuple(range(next_hash, next_hash + count))
        next_hash += count
        event = BlockStored(hashes, None, tokens, BLOCK)
        for pod in rng.sample(pods, args.replicas):
            writer.apply(pod, (event,))
        if len(prompts) < 64:
            prompts.append(tokens)
        while len(writer.pending) > 50_000:
            await asyncio.sleep(0.001)
    while not writer.settled:
        await asyncio.sleep(0.001)
    seconds = time.perf_counter() - started
    task.cancel()
    return {
        "commands": writer.written,
        "seconds": seconds,
        "commands_per_s": writer.written / seconds,
        "prompts": prompts,
    }


async def _lookups(redis: Redis, prompts: list[tuple[int, ...]], rounds: int) -> dict[str, Any]:
    lookup = IndexLookup(redis, deadline_s=1.0)
    names = ["ping", *map(_chain_name, CHAINS), *map(_decision_name, CHAINS)]
    samples: dict[str, list[float]] = {name: [] for name in names}
    # the first prompt's blocks are held, then blocks no pod holds past them
    tokens = [token for prompt in [prompts[0], *prompts] for token in prompt]
    keys = chain(tokens, BLOCK)
    await lookup.block_sizes()
    for _ in range(rounds):
        started = time.perf_counter()
        await redis.ping()
        samples["ping"].append(time.perf_counter() - started)
        for length in CHAINS:
            started = time.perf_counter()
            await lookup.matches(keys[:length])
            samples[_chain_name(length)].append(time.perf_counter() - started)
            started = time.perf_counter()
            await lookup.longest(PromptKeys(tokens[: length * BLOCK]).at)
            samples[_decision_name(length)].append(time.perf_counter() - started)
    return {
        name: {"p50_ms": percentile(values, 50) * 1e3, "p99_ms": percentile(values, 99) * 1e3}
        for name, values in samples.items()
    }


def _decision_name(length: int) -> str:
    return f"decision, {length} blocks"


def _chain_name(length: int) -> str:
    return f"chain of {length} blocks"


def render(report: Report) -> str:
    write, config = report["write"], report["config"]
    lines = [
        f"bench kv-index: {config['blocks']:,} blocks x {config['replicas']} of "
        f"{config['pods']} pods",
        f"  write: {write['commands']:,} commands in {write['seconds']:.2f} s = "
        f"{write['commands_per_s']:,.0f}/s; Redis memory "
        f"{write['bytes_per_million_fields'] / 2**20:,.1f} MiB per million (block, pod) fields",
        "  lookup (one at a time)      p50 ms   p99 ms",
    ]
    for name, row in report["lookup"].items():
        lines.append(f"    {name:<22} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f}")
    return "\n".join(lines)
