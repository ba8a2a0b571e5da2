"""FileSource against real files, including a Kubernetes ConfigMap-style symlink swap."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from prefix_sidecar.membership.sources import FileSource, Member, MembershipError

from .conftest import Watching

POLL_S = 0.05


def configmap_write(mount: Path, generation: int, content: str) -> None:
    """Do what the kubelet does: new timestamped dir, then atomically swap `..data`."""
    data_dir = mount / f"..2024_01_01_00_00_0{generation}.000000"
    data_dir.mkdir()
    (data_dir / "backends.yaml").write_text(content)
    os.utime(data_dir / "backends.yaml", (1_700_000_000, 1_700_000_000))  # same mtime always
    tmp_link = mount / "..data_tmp"
    tmp_link.symlink_to(data_dir.name)
    os.replace(tmp_link, mount / "..data")
    if not (mount / "backends.yaml").is_symlink():
        (mount / "backends.yaml").symlink_to("..data/backends.yaml")


async def test_resolve_reads_yaml_and_reports_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "backends.yaml"
    with pytest.raises(MembershipError, match=f"cannot read backends file {path}"):
        await FileSource(path).resolve()
    path.write_text("- 10.0.0.2:8000\n- {url: 10.0.0.1:8000, weight: 2}\n")
    assert await FileSource(path).resolve() == [
        Member("http://10.0.0.1:8000", 2),
        Member("http://10.0.0.2:8000"),
    ]


async def test_watch_follows_plain_file_rewrites(tmp_path: Path, watching: Watching) -> None:
    path = tmp_path / "backends.json"
    path.write_text('["http://10.0.0.1:8000"]')
    updates = watching(FileSource(path, interval_s=POLL_S))
    assert await updates.next() == ["http://10.0.0.1:8000"]
    path.write_text('{"backends": ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]}')
    assert await updates.next() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    # Same members, different spelling: not a change, so no call.
    path.write_text('["HTTP://10.0.0.2:8000/", "10.0.0.1:8000"]')
    await asyncio.sleep(POLL_S * 5)
    assert len(updates.calls) == 2


async def test_watch_follows_configmap_symlink_swap(tmp_path: Path, watching: Watching) -> None:
    # Same length, same mtime: only the content tells the versions apart.
    configmap_write(tmp_path, 1, "- http://10.0.0.1:8001\n")
    updates = watching(FileSource(tmp_path / "backends.yaml", interval_s=POLL_S))
    assert await updates.next() == ["http://10.0.0.1:8001"]
    configmap_write(tmp_path, 2, "- http://10.0.0.1:8002\n")
    assert await updates.next() == ["http://10.0.0.1:8002"]
    configmap_write(tmp_path, 3, "- http://10.0.0.9:8002\n- http://10.0.0.1:8002\n")
    assert await updates.next() == ["http://10.0.0.1:8002", "http://10.0.0.9:8002"]


async def test_garbage_empty_and_missing_keep_last_good(
    tmp_path: Path, watching: Watching, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="prefix_sidecar.membership.sources")
    path = tmp_path / "backends.yaml"
    path.write_text("- 10.0.0.1:8000\n")
    updates = watching(FileSource(path, interval_s=POLL_S))
    assert await updates.next() == ["http://10.0.0.1:8000"]

    path.write_text("- 10.0.0.1:8000\n- {url: ftp://10.0.0.2}\n")
    await asyncio.sleep(POLL_S * 5)
    assert f"file {path}: {path}: backends[1]: backend 'ftp://10.0.0.2' has scheme" in caplog.text
    assert "keeping the last good membership (1 backends)" in caplog.text
    assert caplog.text.count("has scheme 'ftp'") == 1  # logged once, not every poll

    caplog.clear()
    path.write_text("[]")
    await asyncio.sleep(POLL_S * 5)
    assert "returned no backends" in caplog.text

    caplog.clear()
    path.unlink()
    await asyncio.sleep(POLL_S * 5)
    assert "No such file or directory" in caplog.text
    assert len(updates.calls) == 1  # never called with [] or garbage

    path.write_text("- 10.0.0.3:8000\n")
    assert await updates.next() == ["http://10.0.0.3:8000"]


async def test_garbage_at_start_reports_nothing_until_fixed(
    tmp_path: Path, watching: Watching
) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text("{not: [valid")
    updates = watching(FileSource(path, interval_s=POLL_S))
    await asyncio.sleep(POLL_S * 4)
    assert updates.calls == []
    path.write_text("- 10.0.0.1:8000\n")
    assert await updates.next() == ["http://10.0.0.1:8000"]
