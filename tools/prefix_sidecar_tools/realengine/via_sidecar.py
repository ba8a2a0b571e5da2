"""The real-engine workload through a real sidecar: prefixes registered (and prewarmed) once,
each request a Complete RPC carrying the prefix id and the thin suffix.

    async with ViaSidecar(fleet, prefixes) as via:     # Sidecar on a unix socket, dialed
        via.homes                                      # {prefix index: [home pod url]}
        via.prewarm                                    # what RegisterPrefix(prewarm) did
        results = await run_workload(fleet, requests, send=via.send)

TTFT is timed at the gRPC client, to the first Chunk: it includes the unix-socket hop and
the sidecar's relay, as an application would see it. The serving pod is the first chunk's
`backend`; `run_workload` then reads that pod's log for what it evaluated.

Also here: the routing contract's placement, computed without the sidecar
(`contract_homes`), and a chooser of prefixes whose home pods differ
(`distinct_home_numbers`), for a fleet whose pods hold one prompt each (see
docs/real-engine.md, "Placement").
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from prefix_sidecar import _core
from prefix_sidecar.config import build_config
from prefix_sidecar.lifecycle import AsyncService
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.realengine.pods import LlamaFleet
from prefix_sidecar_tools.realengine.workload import Request, Served, prefix_text

# llama-cpp-python's server has no /health; /v1/models answers 200 once the model is loaded.
HEALTH_PATH = "/v1/models"


def contract_homes(urls: Sequence[str], texts: Sequence[str], replicas: int = 1) -> list[list[str]]:
    """Each text's home set by routing contract v1 (ring over the sorted pod URLs)."""
    ring = _core.Ring(sorted(urls), [1] * len(urls))
    return [ring.preference(_core.prefix_route_key(text), replicas) for text in texts]


def distinct_home_numbers(
    urls: Sequence[str], count: int, *, words: int = 2000, seed: int = 0, limit: int = 10_000
) -> list[int]:
    """The first `count` prefix numbers n whose prefix_text(n) have pairwise different homes.

    Hashing places prefixes at random, so with as many prefixes as pods some pod is usually
    home for two. Picking texts is how the test gives each pod exactly one prefix without
    touching the router; the routing under test is unchanged.
    """
    if count > len(urls):
        raise ValueError(f"{count} prefixes cannot have distinct homes on {len(urls)} pods")
    chosen: list[int] = []
    taken: set[str] = set()
    for number in range(limit):
        (home,) = contract_homes(urls, [prefix_text(number, words, seed)])
        if home[0] not in taken:
            taken.add(home[0])
            chosen.append(number)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"no {count} prefixes with distinct homes among the first {limit}")


@dataclass(frozen=True)
class WarmResult:
    """One PrewarmEvent of RegisterPrefix(prewarm=true), as plain data."""

    prefix: int
    backend: str
    state: str
    elapsed_ms: float
    error: str


class ViaSidecar(AsyncService):
    """A real Sidecar in front of the fleet; registers the workload's prefixes with prewarm.

    `prefixes[i]` is the text of the workload's prefix i (Request.prefix_id == i).
    `settings` override the sidecar's config (e.g. {"replicas": 2}).
    """

    def __init__(
        self,
        fleet: LlamaFleet,
        prefixes: Sequence[str],
        *,
        max_tokens: int = 4,
        settings: Mapping[str, Any] | None = None,
        ready_timeout: float = 15.0,
    ) -> None:
        if not prefixes:
            raise ValueError("ViaSidecar needs at least one prefix to register")
        self.fleet = fleet
        self.prefixes = list(prefixes)
        self.max_tokens = max_tokens
        self.ready_timeout = ready_timeout
        self._socket_dir = tempfile.mkdtemp(prefix="sc-")  # short: sun_path is ~107 bytes
        values: dict[str, Any] = {
            "listen": f"unix://{self._socket_dir}/sidecar.sock",
            "backends": fleet.urls,
            "health_path": HEALTH_PATH,
            "grace_s": 1.0,
        }
        values.update(settings or {})
        self.sidecar = Sidecar(build_config(values))
        self._channel: grpc.aio.Channel | None = None
        self._stub: router_pb2_grpc.RouterStub | None = None
        self.ids: list[str] = []  # the sidecar's prefix id of each workload prefix
        self.homes: dict[int, list[str]] = {}
        self.prewarm: list[WarmResult] = []
        self.prewarm_s = 0.0
        self.marks_after_prewarm: dict[str, int] = {}  # pod url -> log offset

    @property
    def stub(self) -> router_pb2_grpc.RouterStub:
        if self._stub is None:
            raise RuntimeError("ViaSidecar is not started: use `async with`")
        return self._stub

    async def start(self) -> None:
        await self.sidecar.start()
        self._channel = grpc.aio.insecure_channel(self.sidecar.target)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        await self._wait_serving()
        started = time.perf_counter()
        for index, text in enumerate(self.prefixes):
            reply = await self.stub.RegisterPrefix(
                router_pb2.RegisterPrefixRequest(name=f"prefix-{index}", text=text, prewarm=True)
            )
            self.ids.append(reply.id)
            self.homes[index] = list(reply.backends)
            for event in reply.prewarm:
                self.prewarm.append(
                    WarmResult(
                        prefix=index,
                        backend=event.backend,
                        state=router_pb2.PrewarmEvent.State.Name(event.state),
                        elapsed_ms=event.elapsed_ms,
                        error=event.error,
                    )
                )
        self.prewarm_s = time.perf_counter() - started
        failed = [w for w in self.prewarm if w.state != "WARMED"]
        if failed:
            raise RuntimeError(f"prewarm failed on llama.cpp pods: {failed}")
        self.marks_after_prewarm = {pod.url: pod.log_offset() for pod in self.fleet.pods}

    async def _wait_serving(self) -> None:
        """Until the sidecar's own health checks report every pod serving."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout
        wanted = sorted(self.fleet.urls)
        states: dict[str, str] = {}
        while loop.time() < deadline:
            reply = await self.stub.ListBackends(router_pb2.ListBackendsRequest())
            states = {b.url: b.state for b in reply.backends}
            if sorted(states) == wanted and all(s == "serving" for s in states.values()):
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(
            f"the sidecar did not report the llama.cpp pods serving within "
            f"{self.ready_timeout:.0f} s (health path {HEALTH_PATH}): {states}"
        )

    async def send(self, request: Request, seq: int) -> Served:
        """Complete(prefix_id, input=suffix); TTFT to the first chunk, pod from its backend."""
        message = router_pb2.CompleteRequest(
            prefix_id=self.ids[request.prefix_id],
            input=request.suffix,
            max_tokens=self.max_tokens,
            temperature=0.0,
        )
        started = time.perf_counter()
        call = self.stub.Complete(message, timeout=60)
        ttft: float | None = None
        backend = ""
        pieces: list[str] = []
        async for chunk in call:
            if ttft is None:
                ttft = time.perf_counter() - started
                backend = chunk.backend
            pieces.append(chunk.text)
        total = time.perf_counter() - started
        if ttft is None or not backend:
            raise RuntimeError(f"request {seq}: the sidecar streamed no chunk naming a pod")
        return Served(backend, ttft * 1e3, total * 1e3, "".join(pieces))

    async def stop(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None
        await self.sidecar.stop(grace_s=1.0)
        shutil.rmtree(self._socket_dir, ignore_errors=True)
