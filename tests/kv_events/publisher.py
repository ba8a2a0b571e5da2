"""A publisher speaking vLLM's KV-events protocol on real sockets, for the subscriber's
tests: `/kv_event_sources` over HTTP (aiohttp) and an XPUB socket (so a test can wait until
the subscriber has subscribed) with vLLM's replay ROUTER beside it, answering a start
sequence number with the batches it holds from there and an end marker (seq -1, empty)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

from prefix_sidecar.kv_events.decode import KvEvent
from prefix_sidecar.server.app import Sidecar

END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOPIC = b"kv"


def byte_tokens(text: str) -> list[int]:
    return list(text.encode())


def stored(*hashes: int, tokens: int = 2) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": None,
        "token_ids": list(range(tokens * len(hashes))),
        "block_size": tokens,
    }


def payload(*events: dict[str, Any]) -> bytes:
    return msgpack.packb([time.time(), list(events), 0])


@dataclass
class Publisher:
    replay: bool = True
    replay_delay_s: float = 0.0  # before each answer: batches published meanwhile come twice
    replay_ignored: int = 0  # the first requests left unanswered (a pod too busy to answer)
    context: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context)
    held: list[tuple[int, bytes]] = field(default_factory=list)  # what replay can resend
    url: str = ""

    async def __aenter__(self) -> Publisher:
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.context.socket(zmq.ROUTER)
        replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_task = asyncio.create_task(self._serve_replay())
        sources = {
            "0": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{pub_port}",
                "replay_endpoint": f"tcp://*:{replay_port}" if self.replay else None,
                "topic": TOPIC.decode(),
            }
        }

        async def answer(_: web.Request) -> web.Response:
            return web.json_response(sources)

        async def tokenize(request: web.Request) -> web.Response:
            text = (await request.json())["prompt"]
            return web.json_response({"tokens": byte_tokens(text), "count": len(text)})

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/kv_event_sources", answer)
        app.router.add_post("/tokenize", tokenize)  # a byte-level tokenizer
        app.router.add_get("/health", health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        self.replay_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.replay_task
        await self.runner.cleanup()
        self.context.destroy(linger=0)

    async def subscribed(self, timeout_s: float = 10.0) -> None:
        """Returns once a subscriber has subscribed (XPUB hands us its subscription)."""
        async with asyncio.timeout(timeout_s):
            while (await self.pub.recv())[:1] != b"\x01":
                pass

    async def send(self, seq: int, body: bytes, *, publish: bool = True) -> None:
        """Batch `seq`: kept for replay, and published unless `publish` is False (a gap)."""
        self.held.append((seq, body))
        if publish:
            await self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), body])

    async def send_frames(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            if self.replay_ignored > 0:
                self.replay_ignored -= 1
                continue
            await asyncio.sleep(self.replay_delay_s)
            for seq, body in list(self.held):
                if seq >= first:
                    await self.router.send_multipart(
                        [client, b"", TOPIC, seq.to_bytes(8, "big"), body]
                    )
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])


@dataclass
class RecordingSink:
    """What the subscriber told: ("reset", known), ("resume", None) and ("events", events)
    in order."""

    heard: list[tuple[str, object]] = field(default_factory=list)

    def reset(self, pod: str, known: bool) -> None:
        self.heard.append(("reset", known))

    def resume(self, pod: str) -> None:
        self.heard.append(("resume", None))

    def apply(self, pod: str, events: tuple[KvEvent, ...]) -> None:
        self.heard.append(("events", events))

    def events(self) -> list[KvEvent]:
        return [e for kind, batch in self.heard if kind == "events" for e in batch]  # type: ignore[attr-defined]

    async def until(self, predicate: Any, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.01)


def reprewarms(sidecar: Sidecar, reason: str) -> float:
    """The sidecar's prefix_sidecar_reprewarms_total for `reason`."""
    value = sidecar.metrics.registry.get_sample_value(
        "prefix_sidecar_reprewarms_total", {"reason": reason}
    )
    return value or 0.0


def resident_gauge(sidecar: Sidecar, pod: str) -> float | None:
    """The sidecar's prefix_sidecar_resident_prefixes for `pod` (None: no series)."""
    registry = sidecar.metrics.registry
    return registry.get_sample_value("prefix_sidecar_resident_prefixes", {"backend": pod})
