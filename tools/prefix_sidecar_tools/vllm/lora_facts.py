"""What real vLLM does with LoRA adapters and cache salts, asked of a real pod and printed.

    python -m prefix_sidecar_tools.vllm.lora_facts [--startup-checks]

One pod of the tiny model with LoRA (the adapter `lora-a` loaded at start, loading at run
time allowed) and its KV events, then: /v1/models, whether the adapter's prefix cache is
apart from the base model's, an unknown model's answer, cache salts on both APIs and the
salts vLLM refuses, loading and unloading an adapter at run time, and what the KV events
carry for adapters and salts. `--startup-checks` then starts two more pods, one at a time:
`--lora-modules` without `--enable-lora`, and runtime loading without `--enable-lora`.

Every figure printed is what the pod answered (docs/vllm.md quotes them). The emulator
copies these shapes (tools/prefix_sidecar_tools/emulator/adapters.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from prefix_sidecar_tools.vllm import lora
from prefix_sidecar_tools.vllm.fleet import (
    VllmFleet,
    ensure_adapter,
    ensure_tiny_model,
    require_vllm_python,
)
from prefix_sidecar_tools.vllm.tiny_model import document

WORDS = 1500  # about 1,850 tokens: 14 whole blocks of 128
BAD_SALTS: tuple[Any, ...] = ("", 5, "x" * 129, "tenant/a")


def show(title: str, *lines: Any) -> None:
    print(f"\n## {title}")
    for line in lines:
        print(line if isinstance(line, str) else json.dumps(line))


class Pod:
    """A client of one pod: completions and chat with their usage, raw answers."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str) -> None:
        self.session, self.url, self.model = session, url, model

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, str, str]:
        """(status, content type or "-", body text)."""
        async with self.session.post(self.url + path, json=body) as response:
            kind = response.headers.get("Content-Type", "-")
            return response.status, kind, await response.text()

    async def cached(self, prompt: str, model: str = "", chat: bool = False, **extra: Any) -> Any:
        """The cached tokens of one greedy request, or (status, body) when refused."""
        body: dict[str, Any] = {"model": model or self.model, "max_tokens": 1, "temperature": 0}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        status, _, text = await self.post(
            "/v1/chat/completions" if chat else "/v1/completions", {**body, **extra}
        )
        if status != 200:
            return status, text
        return json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"]


@contextlib.asynccontextmanager
async def kv_events(port: int) -> AsyncIterator[list[dict[str, Any]]]:
    """The pod's KV events (maps), appended as they come."""
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(f"tcp://127.0.0.1:{port}")
    events: list[dict[str, Any]] = []

    async def receive() -> None:
        while True:
            _, _, payload = await socket.recv_multipart()
            events.extend(msgpack.unpackb(payload, strict_map_key=False)[1])

    task = asyncio.create_task(receive())
    await asyncio.sleep(0.5)  # a SUB hears only what is sent after it joined
    try:
        yield events
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        context.destroy(linger=0)


def stored_summary(event: dict[str, Any]) -> dict[str, Any]:
    """A BlockStored without its long lists: its fields, and its first two extra keys."""
    extra = event.get("extra_keys")
    return {
        "fields": sorted(event),
        "lora_id": event.get("lora_id"),
        "lora_name": event.get("lora_name"),
        "extra_keys[:2]": extra[:2] if extra else extra,
        "blocks": len(event["block_hashes"]),
        "group_idx": event.get("group_idx"),
        "kv_cache_spec_kind": event.get("kv_cache_spec_kind"),
    }


async def stored_by(events: list[dict[str, Any]], send: Callable[[], Any]) -> dict[str, Any]:
    """The first BlockStored that `send()` makes the pod publish."""
    seen = len(events)
    await send()
    for _ in range(40):
        new = [e for e in events[seen:] if e.get("type") == "BlockStored"]
        if new:
            return stored_summary(new[0])
        await asyncio.sleep(0.05)
    return {"stored": "none within 2 s"}


async def facts(fleet: VllmFleet, adapter_b: Path) -> None:
    url = fleet.urls[0]
    pub = fleet.kv_event_ports[fleet.pods[0].port][0]
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session, kv_events(pub) as events:
        pod = Pod(session, url, fleet.model)
        async with session.get(url + "/v1/models") as response:
            show("GET /v1/models", await response.text())

        p, q = document("facts-base-first", WORDS), document("facts-adapter-first", WORDS)
        base_first = [await pod.cached(p, m) for m in (fleet.model,) * 2 + ("lora-a",) * 2]
        adapter_first = [await pod.cached(q, m) for m in ("lora-a",) + (fleet.model,) * 2]
        show(
            "cached tokens: a prompt under the base model twice, then under lora-a twice",
            base_first,
            "another: under lora-a, then the base model twice",
            adapter_first,
        )

        for chat in (False, True):
            path = "/v1/chat/completions" if chat else "/v1/completions"
            body: dict[str, Any] = {"model": "nope", "max_tokens": 1}
            body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {})
            body.update({} if chat else {"prompt": "hi"})
            show(f"unknown model on {path}", await pod.post(path, body))

        for chat in (False, True):
            text = document(f"facts-salt-{chat}", WORDS)
            order = ["tenant-a", "tenant-b", None, "tenant-a", "tenant-b", None]
            seen = []
            for salt in order:
                extra = {"cache_salt": salt} if salt else {}
                seen.append((salt, await pod.cached(text, chat=chat, **extra)))
            adapter = [await pod.cached(text, "lora-a", chat, cache_salt="tenant-a")]
            adapter.append(await pod.cached(text, "lora-a", chat, cache_salt="tenant-a"))
            show(f"cache_salt, chat={chat}: (salt, cached tokens) in order", *seen)
            show(f"the same under lora-a with tenant-a, chat={chat}", adapter)
        for salt in BAD_SALTS:
            show(f"cache_salt {salt!r}", await pod.cached("hi", cache_salt=salt))

        show(
            "POST /v1/load_lora_adapter lora-b, then again, then a missing folder",
            await pod.post("/v1/load_lora_adapter", _load("lora-b", adapter_b)),
            await pod.post("/v1/load_lora_adapter", _load("lora-b", adapter_b)),
            await pod.post("/v1/load_lora_adapter", _load("lora-c", Path("/nonexistent"))),
            await pod.post("/v1/load_lora_adapter", {"lora_name": "lora-d"}),
        )
        show("/v1/models after it", [(c["id"], c["parent"]) for c in await _models(pod)])
        show("cached tokens under lora-b (the first prompt), twice", [
            await pod.cached(p, "lora-b"), await pod.cached(p, "lora-b")
        ])  # fmt: skip
        unload = {"lora_name": "lora-b"}
        show(
            "POST /v1/unload_lora_adapter lora-b, then again, then a request for it",
            await pod.post("/v1/unload_lora_adapter", unload),
            await pod.post("/v1/unload_lora_adapter", unload),
            await pod.cached(p, "lora-b"),
        )

        r = document("facts-events", 300)
        show(
            "KV events: BlockStored for base, lora-a, salted base, salted lora-a",
            await stored_by(events, lambda: pod.cached(r)),
            await stored_by(events, lambda: pod.cached(r, "lora-a")),
            await stored_by(events, lambda: pod.cached(r, cache_salt="tenant-a")),
            await stored_by(events, lambda: pod.cached(r, "lora-a", cache_salt="tenant-a")),
        )


def _load(name: str, path: Path) -> dict[str, str]:
    return {"lora_name": name, "lora_path": str(path)}


async def _models(pod: Pod) -> list[dict[str, Any]]:
    return await lora.served_models(pod.session, pod.url)


async def startup_checks(python: Path, model: Path, adapter: Path) -> None:
    """Two pods without --enable-lora, one at a time."""
    scratch = Path(tempfile.mkdtemp(prefix="lf-"))  # kept past the fleet: the log is read
    lora_modules = ["--lora-modules", f"lora-a={adapter}"]
    static = VllmFleet(model, 1, python=python, scratch=scratch, extra_args=lora_modules)
    try:
        async with static:
            show("--lora-modules without --enable-lora", "started")
    except (RuntimeError, TimeoutError):
        errors = [line for line in static.pods[0].log_text().splitlines() if "Error" in line]
        show("--lora-modules without --enable-lora: did not start; its log says", *errors[-2:])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    runtime = VllmFleet(model, 1, python=python, extra_env=lora.RUNTIME_UPDATING_ENV)
    async with runtime, aiohttp.ClientSession() as session:
        pod = Pod(session, runtime.urls[0], runtime.model)
        show(
            "runtime loading without --enable-lora: load lora-a, then a request for it",
            await pod.post("/v1/load_lora_adapter", _load("lora-a", adapter)),
            await pod.cached("hi", "lora-a"),
        )


async def main_async(checks: bool) -> int:
    python = require_vllm_python()
    model = ensure_tiny_model(python)
    adapter_a = ensure_adapter(python, model, "lora-a")
    adapter_b = ensure_adapter(python, model, "lora-b")
    fleet = VllmFleet(
        model, 1, python=python, kv_events=True, lora_modules={"lora-a": adapter_a},
        runtime_lora=True,
    )  # fmt: skip
    async with fleet:
        show("pod", f"{fleet.urls[0]} ready in {fleet.pods[0].ready_s:.1f} s", fleet.lora_args())
        await facts(fleet, adapter_b)
    if checks:
        await startup_checks(python, model, adapter_a)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--startup-checks",
        action="store_true",
        help="also start pods without --enable-lora (two more starts, one at a time)",
    )
    args = parser.parse_args(argv)
    return asyncio.run(main_async(args.startup_checks))


if __name__ == "__main__":
    sys.exit(main())
