"""The client verbs that list, against a running sidecar: `backends` and `prefixes` print
one line per item, say so when there is none, and print the reply itself with --json."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from prefix_sidecar.cli import main
from prefix_sidecar.server.app import Sidecar


async def run_verb(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """`prefix-sidecar ARGV` in a thread (it runs its own event loop), and what it printed."""
    code = await asyncio.to_thread(main, list(argv))
    return code, capsys.readouterr().out


async def test_backends_prints_each_pod_with_its_state(
    sidecar: Sidecar, pods: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = await run_verb(capsys, "backends", "--socket", sidecar.socket_path)
    assert code == 0
    rows = [line.split() for line in out.splitlines()]
    assert [row[0] for row in rows] == sorted(pods)
    assert all(row[1:3] == ["serving", "weight=1"] for row in rows), out
    code, out = await run_verb(capsys, "backends", "--json", "--socket", sidecar.socket_path)
    assert code == 0
    assert sorted(b["url"] for b in json.loads(out)["backends"]) == sorted(pods)


async def test_prefixes_prints_none_then_the_registered_one(
    sidecar: Sidecar, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    socket = ("--socket", sidecar.socket_path)
    assert await run_verb(capsys, "prefixes", *socket) == (0, "(no prefixes)\n")
    rules = tmp_path / "rules.txt"
    rules.write_text("Rule: no absolute claims in promotion copy. " * 50, encoding="utf-8")
    code, out = await run_verb(
        capsys, "prefixes", "register", "--name", "rules", "--file", str(rules), *socket
    )
    assert code == 0
    prefix_id = out.split()[0]
    code, out = await run_verb(capsys, "prefixes", "list", *socket)
    assert code == 0
    (row,) = [line.split() for line in out.splitlines()]
    size = len(rules.read_bytes())
    assert row[:4] == [prefix_id[:16], "rules", str(size), "bytes"]
    assert row[5].removeprefix("backends=").split(",")[0].startswith("http://127.0.0.1:")
