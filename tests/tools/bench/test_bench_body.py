"""`prefix-sidecar bench body`: every reader read every shape, each in its own child process.

Checks that the report is well formed and that the readers read the bodies, not the figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefix_sidecar_tools.bench.body import READERS, SHAPES, render
from tests.cli import run_cli

# Load or timing measured on a shared machine: `make test` runs these alone, one at a time.
pytestmark = pytest.mark.timing


def test_small_body_report_is_well_formed(tmp_path: Path) -> None:
    report_path = tmp_path / "body.json"
    done = run_cli("bench", "body", "--repeat", "1", "--scale", "0.01", "--json", str(report_path))
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    rows = report["rows"]
    assert [(row["shape"], row["reader"]) for row in rows] == [
        (shape, reader) for shape in SHAPES for reader in READERS
    ]
    for row in rows:
        assert row["bytes"] > 0 and row["total_ms"] >= 0 and row["longest_step_ms"] >= 0, row
        assert row["peak_mib"] is None or row["peak_mib"] >= 0, row
    assert "longest step ms" in render(report) and "240 KB prompt" in done.stdout
