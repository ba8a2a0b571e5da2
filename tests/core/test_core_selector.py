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


def _copy_without_extension(tmp_path: Path) -> Path:
    """The runtime package as a build without a compiler leaves it: no _core_c."""
    import shutil

    package = tmp_path / "prefix_sidecar"
    shutil.copytree(
        ROOT / "prefix_sidecar", package, ignore=shutil.ignore_patterns("_core_c*", "__pycache__")
    )
    return package


def _import_core(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SIDECAR_NO_EXTENSIONS"}
    env["PYTHONPATH"] = str(tmp_path)
    # An editable install's finder would find the checkout's extension for the copied package:
    # drop it, so the copy imports as an installed package would.
    code = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path"
        " if not getattr(f, '__module__', '').startswith('__editable__')]; "
        "import prefix_sidecar._core as c; print(c.IMPLEMENTATION)"
    )
    return subprocess.run(  # in tmp_path: `-c` puts the working directory first on the path
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
        cwd=tmp_path,
    )  # fmt: skip


def test_a_missing_extension_falls_back_to_the_twin(tmp_path: Path) -> None:
    _copy_without_extension(tmp_path)
    result = _import_core(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["python"]


def test_a_broken_extension_fails_loudly(tmp_path: Path) -> None:
    """An extension that is there but cannot load (an ABI mismatch, a missing symbol) must not
    fall back to the ~10x slower twin without a word."""
    package = _copy_without_extension(tmp_path)
    (package / "_core_c.py").write_text('raise ImportError("undefined symbol: murmur3_x64")\n')
    result = _import_core(tmp_path)
    assert result.returncode != 0
    assert "undefined symbol: murmur3_x64" in result.stderr
