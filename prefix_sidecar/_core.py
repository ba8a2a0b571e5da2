"""Select the routing core: the Cython extension, or its pure-Python twin.

`SIDECAR_NO_EXTENSIONS=1` forces the twin. Under TYPE_CHECKING mypy reads the twin, so the
twin is the typed source of truth for both. Only a missing extension (an install without a
compiler) falls back to the twin: an extension that is there but fails to load raises, since
the twin is ~10x slower and a silent fallback would hide that.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

NO_EXTENSIONS = bool(os.environ.get("SIDECAR_NO_EXTENSIONS"))

if TYPE_CHECKING or NO_EXTENSIONS:
    import prefix_sidecar._core_py as _impl
else:
    try:
        import prefix_sidecar._core_c as _impl
    except ModuleNotFoundError as exc:  # pragma: no cover - an install without a compiler
        if exc.name != "prefix_sidecar._core_c":
            raise
        import prefix_sidecar._core_py as _impl

IMPLEMENTATION = "python" if _impl.__name__.endswith("_core_py") else "cython"

BRANCH_FALLBACK = _impl.BRANCH_FALLBACK
BRANCH_HOME = _impl.BRANCH_HOME
BRANCH_SPILL = _impl.BRANCH_SPILL
DEFAULT_TABLE_SIZE = _impl.DEFAULT_TABLE_SIZE
DEFAULT_VNODES = _impl.DEFAULT_VNODES
HASH_TABLES = _impl.HASH_TABLES
MAX_BLOCK_BYTES = _impl.MAX_BLOCK_BYTES
HashTable = _impl.HashTable
Maglev = _impl.Maglev
Ring = _impl.Ring
chain_keys = _impl.chain_keys
make_table = _impl.make_table
prefix_id = _impl.prefix_id
prefix_route_key = _impl.prefix_route_key
route_key = _impl.route_key

__all__ = [
    "BRANCH_FALLBACK",
    "BRANCH_HOME",
    "BRANCH_SPILL",
    "DEFAULT_TABLE_SIZE",
    "DEFAULT_VNODES",
    "HASH_TABLES",
    "IMPLEMENTATION",
    "MAX_BLOCK_BYTES",
    "HashTable",
    "Maglev",
    "Ring",
    "chain_keys",
    "make_table",
    "prefix_id",
    "prefix_route_key",
    "route_key",
]
