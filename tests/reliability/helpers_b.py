"""Helpers for the fault, soak and shutdown tests (reliability part B).

Everything here is a real part: emulated pods as OS processes (EmulatorFleet), the real
Sidecar on a unix socket, a real dnslib DNS server on 127.0.0.1, gRPC over the socket. The
helpers only observe: stream a call and classify how it ended, poll ListBackends for a
pod's state, and watch grpc.health.v1 in the background to prove the sidecar never
stopped SERVING while a fault was going on.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_sidecar.config import Config, build_config
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.emulator import EmulatorConfig
from tests.background import BackgroundWatch

# 20x real time: a 200-token answer streams for ~0.3 s, long enough to cut it midway.
FAULT_PODS = EmulatorConfig(time_scale=20.0, max_running=256)
PREFIX_TOKENS = 5_000
PARTIAL_WORD = "partial"


def prefix_text(name: str, tokens: int = PREFIX_TOKENS) -> str:
    """A prefix of ~tokens emulator tokens (4 bytes each) whose first bytes name it."""
    line = f"{name}: platform compliance rules, commission table, banned words.\n"
    return (line * (tokens * 4 // len(line) + 1))[: tokens * 4]


@contextlib.contextmanager
def short_tmpdir() -> Iterator[Path]:
    """A short directory for unix sockets (sun_path holds ~107 bytes; tmp_path can be longer)."""
    path = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fault_config(socket_dir: Path, **values: Any) -> Config:
    """A sidecar config for fault tests: quick health checks and membership polls."""
    merged: dict[str, Any] = {
        "listen": f"unix://{socket_dir}/sidecar.sock",
        "health_interval_s": 0.5,
        "health_timeout_s": 0.5,
        "eject_after_failures": 3,
        "file_interval_s": 0.1,
        "dns_interval_s": 0.2,
        "grace_s": 2.0,
        "first_token_timeout_s": 5.0,
        "max_attempts": 3,
    }
    merged.update(values)
    return build_config(merged)


@dataclass
class Client:
    sidecar: Sidecar
    channel: grpc.aio.Channel
    stub: router_pb2_grpc.RouterStub
    health: health_pb2_grpc.HealthStub


@contextlib.asynccontextmanager
async def running_sidecar(config: Config) -> AsyncIterator[Client]:
    """The real Sidecar in this process (its logs reach caplog) and a channel to it."""
    sidecar = Sidecar(config)
    await sidecar.start()
    channel = grpc.aio.insecure_channel(config.listen)
    try:
        yield Client(
            sidecar,
            channel,
            router_pb2_grpc.RouterStub(channel),
            health_pb2_grpc.HealthStub(channel),
        )
    finally:
        await channel.close()
        await sidecar.stop(grace_s=0.5)


# --- observing -----------------------------------------------------------------------------


class ServingWatch(BackgroundWatch):
    """Polls grpc.health.v1 Check ("" and "sidecar.v1.Router") all along a test.

    `async with ServingWatch(client.health) as watch:` ... then `watch.assert_always_serving()`.
    """

    def __init__(self, health: health_pb2_grpc.HealthStub, every_s: float = 0.05) -> None:
        self.health = health
        self.every_s = every_s
        self.checks = 0
        self.bad: list[str] = []

    async def watch(self) -> None:
        while True:
            for service in ("", "sidecar.v1.Router"):
                try:
                    reply = await self.health.Check(
                        health_pb2.HealthCheckRequest(service=service), timeout=2.0
                    )
                    if reply.status != health_pb2.HealthCheckResponse.SERVING:
                        name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                        self.bad.append(f"{service or '<all>'}: {name}")
                except grpc.aio.AioRpcError as exc:
                    self.bad.append(f"{service or '<all>'}: {exc.code().name} {exc.details()}")
                self.checks += 1
            await asyncio.sleep(self.every_s)

    def assert_always_serving(self, at_least: int = 4) -> None:
        assert not self.bad, f"the sidecar stopped SERVING during the fault: {self.bad[:5]}"
        assert self.checks >= at_least, f"only {self.checks} health checks ran"


@dataclass
class StreamResult:
    """How one streaming call ended, as the caller sees it."""

    text: str = ""
    chunks: int = 0
    backend: str = ""
    attempts: int = 0
    finish_reason: str = ""
    usage: tuple[int, int, int] = (0, 0, 0)  # prompt, completion, cached
    code: grpc.StatusCode | None = None
    message: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.code is None and bool(self.finish_reason)

    @property
    def partial(self) -> bool:
        """Cut after the first token, and the caller is told the text is partial."""
        return (
            self.code == grpc.StatusCode.UNAVAILABLE
            and self.chunks > 0
            and PARTIAL_WORD in self.message
        )

    @property
    def outcome(self) -> str:
        if self.ok:
            return "ok" if self.attempts <= 1 else "ok_after_failover"
        if self.partial:
            return "partial"
        return "lost"

    def __str__(self) -> str:
        end = self.code.name if self.code else f"finish={self.finish_reason}"
        return f"{self.outcome} via {self.backend or '-'} ({end}: {self.message[:200]})"


async def stream_complete(
    stub: router_pb2_grpc.RouterStub, request: router_pb2.CompleteRequest, timeout: float = 10.0
) -> StreamResult:
    result = StreamResult()
    started = time.perf_counter()
    try:
        async for chunk in stub.Complete(request, timeout=timeout):
            if result.chunks == 0:
                result.backend, result.attempts = chunk.backend, chunk.attempts
            result.chunks += 1
            result.text += chunk.text
            result.finish_reason = chunk.finish_reason or result.finish_reason
            if chunk.HasField("usage"):
                usage = chunk.usage
                result.usage = (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
    except grpc.aio.AioRpcError as exc:
        result.code, result.message = exc.code(), exc.details() or ""
    result.seconds = time.perf_counter() - started
    return result


def query(prefix: str, text: str, max_tokens: int = 32) -> router_pb2.CompleteRequest:
    """A greedy (deterministic) completion of a registered prefix, or of `text` alone."""
    request = router_pb2.CompleteRequest(input=text, max_tokens=max_tokens, temperature=0.0)
    if prefix:
        request.prefix_name = prefix
    return request


async def register(client: Client, name: str, tokens: int = PREFIX_TOKENS) -> router_pb2.Prefix:
    """Register and prewarm a prefix; returns it (backends[0] is its home pod)."""
    reply = await client.stub.RegisterPrefix(
        router_pb2.RegisterPrefixRequest(name=name, text=prefix_text(name, tokens), prewarm=True),
        timeout=30,
    )
    assert reply.backends, f"prefix {name} has no home pod"
    return reply


async def backend_states(stub: router_pb2_grpc.RouterStub) -> dict[str, str]:
    reply = await stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5)
    return {b.url: b.state for b in reply.backends}


async def wait_state(
    stub: router_pb2_grpc.RouterStub,
    url: str,
    state: str,
    timeout: float = 10.0,
    every_s: float = 0.02,
) -> float:
    """Poll ListBackends until `url` is in `state`; returns the seconds it took."""
    started = time.perf_counter()
    seen: list[str] = []
    while True:
        current = (await backend_states(stub)).get(url, "absent")
        if not seen or seen[-1] != current:
            seen.append(current)
        if current == state:
            return time.perf_counter() - started
        if time.perf_counter() - started > timeout:
            pytest.fail(f"{url} not {state!r} after {timeout} s; states seen: {seen}")
        await asyncio.sleep(every_s)


async def wait_all_serving(
    stub: router_pb2_grpc.RouterStub, urls: list[str], timeout: float = 10.0
) -> None:
    for url in urls:
        await wait_state(stub, url, "serving", timeout)
    assert set(await backend_states(stub)) == set(urls)


async def wait_logged(caplog: pytest.LogCaptureFixture, text: str, timeout: float = 5.0) -> str:
    """Wait for a log record containing `text`; returns its message."""
    deadline = time.monotonic() + timeout
    while True:
        for record in caplog.records:
            message = record.getMessage()
            if text in message:
                return message
        if time.monotonic() > deadline:
            pytest.fail(f"nothing logged containing {text!r} within {timeout} s")
        await asyncio.sleep(0.02)


# --- a real DNS server -----------------------------------------------------------------


class SwitchableResolver(BaseResolver):
    """Answers A queries for one name; `mode` switches between the records, an empty
    answer (NOERROR, no records) and SERVFAIL."""

    def __init__(self, name: str, ips: list[str]) -> None:
        self.name = name.rstrip(".").lower()
        self.ips = list(ips)
        self.mode = "records"
        self.queries = 0
        self._lock = threading.Lock()

    def resolve(self, request: DNSRecord, handler: object) -> DNSRecord:
        reply = request.reply()
        with self._lock:
            self.queries += 1
            mode, ips = self.mode, list(self.ips)
        if str(request.q.qname).rstrip(".").lower() != self.name:
            reply.header.rcode = RCODE.NXDOMAIN
        elif mode == "servfail":
            reply.header.rcode = RCODE.SERVFAIL
        elif mode == "records" and QTYPE[request.q.qtype] == "A":
            for ip in ips:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=1))
        return reply


@dataclass
class DnsServer:
    resolver: SwitchableResolver
    port: int = 0
    _server: DNSServer | None = field(default=None, repr=False)

    def __enter__(self) -> DnsServer:
        quiet = DNSLogger(logf=lambda _line: None)
        self._server = DNSServer(self.resolver, port=0, address="127.0.0.1", logger=quiet)
        self.port = self._server.server.server_address[1]
        threading.Thread(
            target=self._server.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.server.shutdown()
            self._server.server.server_close()

    def sidecar_config(self, socket_dir: Path, port: int, **values: Any) -> Config:
        """A fault config whose pods are the resolver's name at `port`, asked of this server."""
        return fault_config(
            socket_dir,
            backends_dns=f"{self.resolver.name}:{port}",
            dns_nameserver=f"127.0.0.1:{self.port}",
            **values,
        )

    async def wait_queries(self, more: int, timeout: float = 5.0) -> None:
        """Wait until the sidecar asked `more` further questions (so it saw the change)."""
        target = self.resolver.queries + more
        deadline = time.monotonic() + timeout
        while self.resolver.queries < target:
            if time.monotonic() > deadline:
                pytest.fail(f"the sidecar asked DNS only {self.resolver.queries} times")
            await asyncio.sleep(0.02)
