"""Select the routing core: the Cython extension, or its pure-Python twin.

`SIDECAR_NO_EXTENSIONS=1` forces the twin. Under TYPE_CHECKING mypy reads the twin, so the
twin is the typed source of truth for both.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

NO_EXTENSIONS = bool(os.environ.get("SIDECAR_NO_EXTENSIONS"))

if TYPE_CHECKING or NO_EXTENSIONS:
    from sidecar._core_py import (
        BRANCH_FALLBACK,
        BRANCH_HOME,
        BRANCH_SPILL,
        DEFAULT_TABLE_SIZE,
        DEFAULT_VNODES,
        HASH_TABLES,
        MAX_BLOCK_BYTES,
        HashTable,
        Maglev,
        Ring,
        chain_keys,
        make_table,
        prefix_id,
        prefix_route_key,
        route_key,
    )

    IMPLEMENTATION = "python"
else:
    try:
        from sidecar._core_c import (
            BRANCH_FALLBACK,
            BRANCH_HOME,
            BRANCH_SPILL,
            DEFAULT_TABLE_SIZE,
            DEFAULT_VNODES,
            HASH_TABLES,
            MAX_BLOCK_BYTES,
            HashTable,
            Maglev,
            Ring,
            chain_keys,
            make_table,
            prefix_id,
            prefix_route_key,
            route_key,
        )

        IMPLEMENTATION = "cython"
    except ImportError:  # pragma: no cover - an install without a compiler
        from sidecar._core_py import (
            BRANCH_FALLBACK,
            BRANCH_HOME,
            BRANCH_SPILL,
            DEFAULT_TABLE_SIZE,
            DEFAULT_VNODES,
            HASH_TABLES,
            MAX_BLOCK_BYTES,
            HashTable,
            Maglev,
            Ring,
            chain_keys,
            make_table,
            prefix_id,
            prefix_route_key,
            route_key,
        )

        IMPLEMENTATION = "python"

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
