"""Sources against hostile inputs (issue 11, items 10 and 13): a backends file that is not a
regular file or is too big, a read that hangs, and member addresses that cannot be pods."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from prefix_sidecar.membership.sources import (
    DnsSource,
    FileSource,
    MembershipError,
    StaticSource,
    file_source,
    special_address,
)

from .conftest import DnsFixture


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("fifo", "it is a FIFO, not a regular file"),
        ("dev_zero", "it is a character device, not a regular file"),
        ("directory", "it is a directory, not a regular file"),
        ("huge", "2000000 bytes, over the 1048576-byte limit"),
    ],
)
async def test_only_a_small_regular_file_is_read(tmp_path: Path, kind: str, reason: str) -> None:
    path = tmp_path / "backends.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"#" * 2_000_000)
    started = time.perf_counter()
    with pytest.raises(MembershipError) as info:
        await FileSource(path).resolve()
    assert time.perf_counter() - started < 1.0
    assert str(info.value) == f"cannot read backends file {path}: {reason}"


async def test_a_hung_read_times_out_and_is_not_started_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read stuck in the kernel (a hung network mount) cannot be made here: the read
    function is replaced by one that blocks until released."""
    release = threading.Event()
    calls = []

    def stuck(path: Path, limit: int) -> bytes:
        calls.append(path)
        release.wait(10)
        return b"- http://10.0.0.1:8000\n"

    monkeypatch.setattr(file_source, "read_regular_file", stuck)
    source = FileSource(tmp_path / "backends.yaml")
    source.read_timeout_s = 0.2
    with pytest.raises(MembershipError, match=r"no answer within 0\.2 s"):
        await source.resolve()
    with pytest.raises(MembershipError, match="an earlier read is still stuck"):
        await source.resolve()
    assert len(calls) == 1
    release.set()
    for _ in range(100):
        try:
            members = await source.resolve()
            break
        except MembershipError:
            await asyncio.sleep(0.01)
    assert [m.url for m in members] == ["http://10.0.0.1:8000"]


@pytest.mark.parametrize(
    ("url", "refused"),
    [
        ("http://0.0.0.0:8000", True),
        ("http://[::]:8000", True),
        ("http://169.254.169.254:80", True),
        ("http://169.254.0.1:8000", True),
        ("http://[fe80::1]:8000", True),
        ("http://224.0.0.1:8000", True),
        ("http://[ff02::1]:8000", True),
        ("http://255.255.255.255:8000", True),
        ("http://[::ffff:169.254.169.254]:8000", True),
        ("http://127.0.0.1:8000", False),
        ("http://127.9.9.9:8000", False),
        ("http://[::1]:8000", False),
        ("http://10.0.0.5:8000", False),
        ("http://[fd00::1]:8000", False),
        ("http://vllm-0.vllm:8000", False),
    ],
)
def test_special_addresses(url: str, refused: bool) -> None:
    assert (special_address(url) is not None) == refused


def test_static_list_refuses_special_addresses(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    source = StaticSource(["http://10.0.0.1:8000", "http://169.254.169.254:80"])
    assert source.description == "static list (1 backends)"
    assert "refusing backend http://169.254.169.254:80" in caplog.text
    with pytest.raises(ValueError, match="every static backend was refused"):
        StaticSource(["http://0.0.0.0:8000"])
    allowed = StaticSource(["http://0.0.0.0:8000"], allow_special=True)
    assert allowed.description == "static list (1 backends)"


async def test_dns_aaaa_records_at_special_addresses_are_refused(
    dns_server: DnsFixture, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    dns_server.resolver.set("vllm.test", ["::1", "::", "fe80::1", "ff02::1", "10.0.0.7"])
    source = DnsSource("vllm.test", 8000, nameserver="127.0.0.1", nameserver_port=dns_server.port)
    for _ in range(2):  # each refused record is warned about once, not at every poll
        members = await source.resolve()
        assert [m.url for m in members] == ["http://10.0.0.7:8000", "http://[::1]:8000"]
    for ip in ("::", "fe80::1", "ff02::1"):
        warned = [r for r in caplog.records if f"AAAA record {ip} of vllm.test" in r.getMessage()]
        assert len(warned) == 1, ip
