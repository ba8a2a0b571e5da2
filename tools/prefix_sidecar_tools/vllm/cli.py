"""`prefix-sidecar vllm-fleet`: start N real vLLM pods on 127.0.0.1 and serve until told.

Builds the tiny model once (into .artifacts/vllm-tiny/; `--second-model`: the second one,
served as tiny-llama-b), starts the pods from the vLLM venv (`make vllm-venv`), one core
each in turn, and prints one URL per line, then `PODS url1,url2,...` for scripts. `--lora
NAME` builds a LoRA adapter of the model called NAME and has every pod load it at start;
`--runtime-lora` lets callers load and unload adapters at run time
(`POST /v1/load_lora_adapter`). Stops every pod and its workers on Ctrl-C, SIGTERM or the
end of stdin (so a script that pipes into it and exits takes the fleet with it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

from prefix_sidecar_tools.harness import stop_on_signals
from prefix_sidecar_tools.vllm.fleet import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    MODEL_A,
    MODEL_B,
    VllmFleet,
    VllmUnavailable,
    ensure_adapter,
    ensure_tiny_model,
    require_vllm_python,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "vllm-fleet",
        help="run a fleet of real vLLM pods (CPU, tiny model)",
        description="Start N real vLLM pods on 127.0.0.1 from the vLLM venv (make vllm-venv).",
    )
    parser.add_argument("--pods", type=int, default=2, help="number of pods (2)")
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=DEFAULT_KV_BYTES,
        help=f"KV cache per pod in bytes; 2,048 a token ({DEFAULT_KV_BYTES})",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN, help="context length"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"KV block size in tokens, a multiple of 32 ({DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help=f"where the tiny model is built and cached (.artifacts/{MODEL_A.folder}, "
        f"with --second-model .artifacts/{MODEL_B.folder})",
    )
    parser.add_argument(
        "--second-model",
        action="store_true",
        help=f"serve the second tiny model (other weights) as {MODEL_B.served!r}",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME",
        help="build a LoRA adapter of the model called NAME and load it at start (repeatable)",
    )
    parser.add_argument(
        "--runtime-lora",
        action="store_true",
        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.pods < 1:
        print("prefix-sidecar vllm-fleet: error: --pods must be >= 1", file=sys.stderr)
        return 2
    try:
        python = require_vllm_python()
        spec = MODEL_B if args.second_model else MODEL_A
        model_dir = args.model_dir or spec.path
        model = ensure_tiny_model(python, model_dir, weights_seed=spec.weights_seed)
        adapters = {name: ensure_adapter(python, model, name) for name in args.lora}
        fleet = VllmFleet(
            model,
            args.pods,
            python=python,
            served_model=spec.served,
            kv_cache_bytes=args.kv_cache_bytes,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            lora_modules=adapters,
            runtime_lora=args.runtime_lora,
        )
        return asyncio.run(_serve(fleet))
    except (VllmUnavailable, ValueError, RuntimeError, TimeoutError) as exc:
        print(f"prefix-sidecar vllm-fleet: {exc}", file=sys.stderr)
        return 1


def _set_at_eof(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Read stdin to its end, then set `stop`. A daemon thread, not the loop's executor:
    a blocked read must not hold up the exit after Ctrl-C."""
    while sys.stdin.buffer.read(65536):
        pass
    loop.call_soon_threadsafe(stop.set)


async def _serve(fleet: VllmFleet) -> int:
    loop = asyncio.get_running_loop()
    stop = stop_on_signals()
    started = time.monotonic()
    async with fleet:
        print(
            f"{len(fleet.pods)} vLLM pods ready in {time.monotonic() - started:.1f} s, "
            f"model {fleet.model!r}",
            file=sys.stderr,
        )
        for name, path in fleet.lora_modules.items():
            print(f"LoRA adapter {name!r}: {path}", file=sys.stderr)
        for url in fleet.urls:
            print(url)
        print("PODS " + ",".join(fleet.urls), flush=True)
        threading.Thread(target=_set_at_eof, args=(loop, stop), daemon=True).start()
        reported: set[str] = set()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                for pod in fleet.pods:
                    exited = pod.process is not None and pod.process.returncode is not None
                    if exited and pod.url not in reported:
                        reported.add(pod.url)
                        print(f"pod {pod.url} exited", file=sys.stderr, flush=True)
        print("stopping pods", file=sys.stderr, flush=True)
    return 0
