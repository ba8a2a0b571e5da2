"""Fixtures for the routing-core tests: every test runs against both twins, multidict style.

The "c" case imports `prefix_sidecar._core_c` directly, so a failed build fails loudly instead of
silently testing the pure-Python twin twice; it is skipped only when SIDECAR_NO_EXTENSIONS is
set (the CI run that tests the twin alone).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

NO_EXTENSIONS = bool(os.environ.get("SIDECAR_NO_EXTENSIONS"))
HERE = Path(__file__).parent


@pytest.fixture(scope="session", params=["c", "py"])
def core(request: pytest.FixtureRequest) -> ModuleType:
    """One routing core: the Cython extension ("c") or the pure-Python twin ("py")."""
    if request.param == "c":
        if NO_EXTENSIONS:
            pytest.skip("SIDECAR_NO_EXTENSIONS is set: the extension is not under test")
        return importlib.import_module("prefix_sidecar._core_c")
    return importlib.import_module("prefix_sidecar._core_py")


@pytest.fixture(scope="session")
def twins() -> tuple[ModuleType, ModuleType]:
    """(extension, twin) for tests that compare the two."""
    if NO_EXTENSIONS:
        pytest.skip("SIDECAR_NO_EXTENSIONS is set: there is no extension to compare")
    return importlib.import_module("prefix_sidecar._core_c"), importlib.import_module(
        "prefix_sidecar._core_py"
    )


@pytest.fixture(scope="session")
def golden() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((HERE / "golden.json").read_text(encoding="utf-8"))
    return data


def load_reference() -> ModuleType:
    """tests/core/make_golden.py: the contract's reference implementation (not a package)."""
    spec = importlib.util.spec_from_file_location("core_make_golden", HERE / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def reference() -> ModuleType:
    return load_reference()
