"""prefix_sidecar._core really uses the extension (unless told not to), and the switch works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NO_EXTENSIONS = bool(os.environ.get("SIDECAR_NO_EXTENSIONS"))

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(NO_EXTENSIONS, reason="SIDECAR_NO_EXTENSIONS is set")
def test_the_extension_is_in_use() -> None:
    """Fails if the build silently fell back to the pure-Python twin."""
    import prefix_sidecar._core_c

    import prefix_sidecar._core

    assert prefix_sidecar._core.IMPLEMENTATION == "cython"
    assert prefix_sidecar._core.Ring is prefix_sidecar._core_c.Ring
    assert prefix_sidecar._core.route_key is prefix_sidecar._core_c.route_key


def test_no_extensions_forces_the_twin() -> None:
    env = {**os.environ, "SIDECAR_NO_EXTENSIONS": "1", "PYTHONPATH": str(ROOT)}
    code = "import prefix_sidecar._core as c; print(c.IMPLEMENTATION, c.Ring.__module__)"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["python", "prefix_sidecar._core_py"]
