"""DnsSource against a real DNS server (dnslib, UDP on 127.0.0.1) whose records change."""

from __future__ import annotations

import asyncio
import logging

import pytest

from prefix_sidecar.membership.sources import DnsSource, Member, MembershipError

from .conftest import DnsFixture, Watching

NAME = "vllm-headless.llm.svc.cluster.local"
POLL_S = 0.1


def source_for(dns_server: DnsFixture, **kwargs: object) -> DnsSource:
    return DnsSource(
        NAME,
        8000,
        nameserver="127.0.0.1",
        nameserver_port=dns_server.port,
        timeout_s=0.5,
        **kwargs,  # type: ignore[arg-type]
    )


async def test_resolves_all_a_and_aaaa_records(dns_server: DnsFixture) -> None:
    dns_server.resolver.set(NAME, ["10.0.0.2", "10.0.0.1", "fd00::0002", "fd00::1"])
    members = await source_for(dns_server).resolve()
    assert [m.url for m in members] == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
        "http://[fd00::1]:8000",
        "http://[fd00::2]:8000",
    ]
    https = await source_for(dns_server, scheme="https").resolve()
    assert https[0] == Member("https://10.0.0.1:8000")


async def test_one_family_missing_is_normal(dns_server: DnsFixture) -> None:
    dns_server.resolver.set(NAME, ["10.0.0.1"])  # no AAAA: NoAnswer for that family
    assert [m.url for m in await source_for(dns_server).resolve()] == ["http://10.0.0.1:8000"]
    dns_server.resolver.set(NAME, ["fd00::1"])  # IPv6-only cluster
    assert [m.url for m in await source_for(dns_server).resolve()] == ["http://[fd00::1]:8000"]


async def test_nxdomain_and_empty_answer_resolve_to_empty(dns_server: DnsFixture) -> None:
    assert await source_for(dns_server).resolve() == []  # NXDOMAIN for A and AAAA
    dns_server.resolver.set(NAME, [])
    assert await source_for(dns_server).resolve() == []


async def test_server_down_is_a_clear_error(dns_server: DnsFixture) -> None:
    source = source_for(dns_server)
    dns_server.stop()
    with pytest.raises(MembershipError, match=f"lookup of '{NAME}' via 127.0.0.1 port"):
        await source.resolve()


def test_bad_nameserver_is_rejected() -> None:
    with pytest.raises(ValueError, match="must be an IP address"):
        DnsSource(NAME, 8000, nameserver="coredns.kube-system")
    with pytest.raises(ValueError, match="not a valid DNS name"):
        DnsSource("a..b", 8000, nameserver="127.0.0.1")
    with pytest.raises(ValueError, match="use http or https"):
        DnsSource(NAME, 8000, scheme="grpc", nameserver="127.0.0.1")


async def test_watch_follows_changes_and_keeps_last_good(
    dns_server: DnsFixture, watching: Watching, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="prefix_sidecar.membership.sources")
    dns_server.resolver.set(NAME, ["10.0.0.1", "10.0.0.2"])
    updates = watching(source_for(dns_server, interval_s=POLL_S))
    assert await updates.next() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]

    dns_server.resolver.set(NAME, ["10.0.0.2", "10.0.0.3", "fd00::3"])  # scale/restart
    assert await updates.next() == [
        "http://10.0.0.2:8000",
        "http://10.0.0.3:8000",
        "http://[fd00::3]:8000",
    ]

    dns_server.resolver.set(NAME, [])  # empty answer: keep the last good
    queries = dns_server.resolver.queries
    await asyncio.sleep(POLL_S * 4)
    assert dns_server.resolver.queries > queries  # it did re-resolve
    assert "returned no backends; keeping the last good membership (3 backends)" in caplog.text

    caplog.clear()
    dns_server.stop()  # server down: keep the last good
    await asyncio.sleep(POLL_S * 4 + 0.5)
    assert "failed" in caplog.text and "(3 backends)" in caplog.text
    assert len(updates.calls) == 2

    dns_server.resolver.set(NAME, ["10.0.0.4"])
    dns_server.start()  # same port again
    assert await updates.next() == ["http://10.0.0.4:8000"]
