"""Real servers on 127.0.0.1 for the membership tests: a dnslib DNS server whose records
the test edits, and aiohttp backends whose health the test flips; and a source's watch
loop run for the test, its updates collected for the test to wait on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from prefix_sidecar.membership.sources import Member, MembershipSource
from prefix_sidecar_tools.harness import free_port


class EditableResolver(BaseResolver):
    """Answers A/AAAA from `records` (name -> ips); unknown names get NXDOMAIN."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.queries = 0
        self._lock = threading.Lock()

    def set(self, name: str, ips: list[str]) -> None:
        with self._lock:
            self.records[name.rstrip(".").lower()] = list(ips)

    def resolve(self, request: DNSRecord, handler: object) -> DNSRecord:
        reply = request.reply()
        qname = request.q.qname
        qtype = QTYPE[request.q.qtype]
        with self._lock:
            self.queries += 1
            ips = self.records.get(str(qname).rstrip(".").lower())
        if ips is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for ip in ips:
            if qtype == "AAAA" and ":" in ip:
                reply.add_answer(RR(qname, QTYPE.AAAA, rdata=AAAA(ip), ttl=5))
            elif qtype == "A" and ":" not in ip:
                reply.add_answer(RR(qname, QTYPE.A, rdata=A(ip), ttl=5))
        return reply


@dataclass
class DnsFixture:
    resolver: EditableResolver
    port: int
    server: DNSServer | None = None

    def start(self) -> None:
        quiet = DNSLogger(logf=lambda _line: None)
        self.server = DNSServer(self.resolver, port=self.port, address="127.0.0.1", logger=quiet)
        self.port = self.server.server.server_address[1]
        # DNSServer.start_thread() polls for shutdown every 0.5 s; 0.05 s keeps teardown fast.
        threading.Thread(
            target=self.server.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server.server.server_close()
            self.server = None


@pytest.fixture
def dns_server() -> Iterator[DnsFixture]:
    fixture = DnsFixture(EditableResolver(), port=0)
    fixture.start()
    yield fixture
    fixture.stop()


@dataclass
class Backend:
    """A tiny backend: /health and /v1/models answer `status`; counts the checks."""

    status: int = 200
    models_status: int = 200
    hits: list[str] = field(default_factory=list)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> None:
        async def health(request: web.Request) -> web.Response:
            self.hits.append(request.path)
            return web.Response(status=self.status, text="ok" if self.status < 300 else "bad")

        async def models(request: web.Request) -> web.Response:
            self.hits.append(request.path)
            return web.json_response({"data": []}, status=self.models_status)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def backend() -> AsyncIterator[Backend]:
    server = Backend()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def closed_port() -> int:
    """A port nothing listens on: connecting to it is refused."""
    return free_port()


class Updates:
    """Collects on_update calls so tests can wait for the next one."""

    def __init__(self) -> None:
        self.calls: list[list[Member]] = []
        self._changed = asyncio.Event()

    def __call__(self, members: list[Member]) -> None:
        self.calls.append(members)
        self._changed.set()

    async def next(self, timeout: float = 2.0) -> list[str]:
        await asyncio.wait_for(self._changed.wait(), timeout)
        self._changed.clear()
        return [m.url for m in self.calls[-1]]


Watching = Callable[[MembershipSource], Updates]


@pytest.fixture
async def watching() -> AsyncIterator[Watching]:
    """`updates = watching(source)`: run `source.watch` until the test ends."""
    tasks: list[asyncio.Task[None]] = []

    def start(source: MembershipSource) -> Updates:
        updates = Updates()
        tasks.append(asyncio.create_task(source.watch(updates)))
        return updates

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
