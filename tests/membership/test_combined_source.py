"""StaticSource and CombinedSource: static + file + DNS (real dnslib server) as one list."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from prefix_sidecar.membership.sources import (
    CombinedSource,
    DnsSource,
    FileSource,
    Member,
    MembershipError,
    StaticSource,
)

from .conftest import DnsFixture, Watching

NAME = "vllm.test"


async def test_static_source_resolves_and_watch_reports_once(watching: Watching) -> None:
    source = StaticSource(["10.0.0.2:8000", Member("http://10.0.0.1:8000", 3)])
    assert await source.resolve() == [Member("http://10.0.0.1:8000", 3), Member("10.0.0.2:8000")]
    updates = watching(source)
    assert await updates.next() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    await asyncio.sleep(0.1)
    assert len(updates.calls) == 1


def test_static_source_rejects_empty_and_duplicates() -> None:
    with pytest.raises(ValueError, match="empty"):
        StaticSource([])
    with pytest.raises(ValueError, match=r"repeats \['http://a:80'\]"):
        StaticSource(["a", "HTTP://A:80/"])


async def test_union_of_static_file_and_dns(
    tmp_path: Path, dns_server: DnsFixture, watching: Watching, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="prefix_sidecar.membership.sources")
    backends_file = tmp_path / "backends.yaml"
    backends_file.write_text("- {url: 10.0.0.1:8000, weight: 5}\n- 10.0.0.2:8000\n")
    dns_server.resolver.set(NAME, ["10.0.0.2", "10.0.0.3"])
    source = CombinedSource(
        [
            StaticSource(["10.0.0.1:8000"]),  # first source wins: weight 1, not 5
            FileSource(backends_file, interval_s=0.05),
            DnsSource(
                NAME,
                8000,
                interval_s=0.05,
                nameserver="127.0.0.1",
                nameserver_port=dns_server.port,
                timeout_s=0.3,
            ),
        ]
    )
    assert source.interval_s == 0.05
    expected = [
        Member("http://10.0.0.1:8000", 1),
        Member("http://10.0.0.2:8000"),
        Member("http://10.0.0.3:8000"),
    ]
    assert await source.resolve() == expected

    updates = watching(source)
    await updates.next()
    assert updates.calls[-1] == expected  # whole first answer at once, not piecemeal
    dns_server.resolver.set(NAME, ["10.0.0.4"])
    assert await updates.next() == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
        "http://10.0.0.4:8000",
    ]
    # DNS goes away and the file turns to garbage: each keeps its own last good.
    dns_server.stop()
    backends_file.write_text("backends: 42\n")
    await asyncio.sleep(0.8)
    assert len(updates.calls) == 2
    assert f"file {backends_file}: {backends_file}: got int" in caplog.text
    assert f"DNS {NAME}:8000: DNS A lookup of '{NAME}'" in caplog.text
    with pytest.raises(MembershipError, match=f"file {backends_file}: .*got int"):
        await source.resolve()
    # The file recovers while DNS is still down.
    backends_file.write_text("- 10.0.0.9:8000\n")
    assert await updates.next() == [
        "http://10.0.0.1:8000",
        "http://10.0.0.4:8000",
        "http://10.0.0.9:8000",
    ]


def test_combined_needs_a_source() -> None:
    with pytest.raises(ValueError, match="at least one source"):
        CombinedSource([])
