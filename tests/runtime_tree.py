"""The runtime's modules, found on disk: every `.py` of the prefix_sidecar package but the
generated gRPC stubs (prefix_sidecar.v1)."""

from __future__ import annotations

from pathlib import Path

import prefix_sidecar

PACKAGE_DIR = Path(prefix_sidecar.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_modules() -> dict[str, Path]:
    """Module name -> source file, in name order."""
    found = {
        module_name(path): path
        for path in PACKAGE_DIR.rglob("*.py")
        if path.relative_to(PACKAGE_DIR).parts[0] != "v1"
    }
    return dict(sorted(found.items()))
